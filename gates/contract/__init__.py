"""The gate contract: what is compared (two arms), on which workloads, judged by which gates.

A contract is YAML validated into frozen pydantic models. Shared settings (model, engine,
speculative, sampling, seeds) hold for both arms; `arms.baseline` / `arms.candidate` override
only what differs (the fast path under test). Unknown keys are refused everywhere, and every
problem is reported as `FILE:LINE: key.path: what is wrong (what is allowed)`.

The package, in the order a contract goes through it:

    reader.py       the file, read safely (size, encoding, anchors, nesting, numbers), with each key's line
    limits.py       size bounds on what a contract may ask for (raised only by an explicit `limits:` block)
    settings.py     the shared settings, derived from the engine's EngineArgs and SamplingParams
    model.py        Contract, arms as overrides, ArmSettings, the bases of workloads and gates
    checks.py       checks that span sections, warnings, pin_code (--baseline-ref / --candidate-ref)
    load.py         load_contract / parse_contract: all of the above, every problem one ContractError
    feasibility.py  requests the contract's own numbers make impossible (load_feasible_contract)
    errors.py       ContractIssue / ContractError and the readable rendering of pydantic's errors

Public API (stable), importable from here:
    load_contract(path) -> Contract                 # raises ContractError (never anything else)
    parse_contract(data: dict, source="<dict>", lines=None) -> Contract
    load_feasible_contract(path) -> Contract        # also refuses requests that cannot fit max_model_len
    Contract.fingerprint                            # sha256 of canonical JSON (defaults filled in)
    Contract.arm("baseline" | "candidate") -> ArmSettings   # effective model/engine/speculative
    ArmSettings.fingerprint                         # sha256 of the arm's effective engine settings
    contract_warnings(contract), pin_code(contract, refs)
"""
from onecat.gates.contract.checks import contract_warnings, pin_code
from onecat.gates.contract.errors import ContractError, ContractIssue
from onecat.gates.contract.feasibility import impossible_requests, load_feasible_contract
from onecat.gates.contract.limits import DEFAULT_LIMITS, ContractLimits, describe_limits
from onecat.gates.contract.load import load_contract, parse_contract
from onecat.gates.contract.model import (ARM_NAMES, Arms, ArmSettings, ArmSpec, Contract, EngineOverride, GateBase,
                                         ModelOverride, WorkloadBase, canonical_json, sha256_text)
from onecat.gates.contract.reader import load_yaml, read_contract_text
from onecat.gates.contract.settings import (ENGINE_ARGS_IN_CONTRACT, ENGINE_OPTIONS, SAMPLING_IN_CONTRACT, CodeRevision,
                                            CodeSpec, DatasetRef, EngineSpec, ExecutionSpec, ModelSpec, ReasoningSpec,
                                            SamplingSpec, SpeculativeSpec, Strict)

__all__ = [
    "ARM_NAMES", "DEFAULT_LIMITS", "ENGINE_ARGS_IN_CONTRACT", "ENGINE_OPTIONS", "SAMPLING_IN_CONTRACT", "ArmSettings",
    "ArmSpec", "Arms", "CodeRevision", "CodeSpec", "Contract", "ContractError", "ContractIssue", "ContractLimits",
    "DatasetRef", "EngineOverride", "EngineSpec", "ExecutionSpec", "GateBase", "ModelOverride", "ModelSpec",
    "ReasoningSpec", "SamplingSpec", "SpeculativeSpec", "Strict", "WorkloadBase", "canonical_json",
    "contract_warnings", "describe_limits", "impossible_requests", "load_contract", "load_feasible_contract",
    "load_yaml", "parse_contract", "pin_code", "read_contract_text", "sha256_text",
]
