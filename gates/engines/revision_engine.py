"""The onecat engine of a pinned git revision (or the working tree), run in a worker process.

Used for both arms of a contract in which any arm pins `code: {ref}` (gates/revision/): the adapter
interface is the in-process engine's, so runners do not change; each call crosses a pipe to the worker
(gates/revision/worker.py), which imports the engine from that revision's worktree. It is not a backend a
contract names: gate_run picks it for arms whose settings carry resolved code (ArmSettings.code).
"""
from __future__ import annotations

from onecat.gates.contract import ArmSettings
from onecat.gates.engines.base import PromptParams
from onecat.gates.engines.onecat_engine import OnecatEngine, _weights_sha256
from onecat.gates.revision.client import EngineWorker, WorkerTokenizer, params_payload, request_output, score_output


class RevisionEngine(OnecatEngine):
    @classmethod
    def check(cls, arm: ArmSettings) -> list[str]:
        if arm.code is None:
            return ["no engine code was resolved for this arm (gates/revision/resolve.py sets it)"]
        return super().check(arm)

    @classmethod
    def open(cls, arm: ArmSettings, seed: int = 0) -> "RevisionEngine":
        return cls(arm, seed)

    def __init__(self, arm: ArmSettings, seed: int = 0):  # noqa: super().__init__ would load the engine here
        self.code = arm.code
        self.template_kwargs = arm.reasoning.template_kwargs()
        self.model_sha256 = _weights_sha256(arm)
        self.worker = EngineWorker(arm.name, arm.code)
        try:
            opened = self.worker.call("open", arm.engine_args(seed).as_kwargs(), self.template_kwargs)
        except BaseException:
            self.worker.close()
            raise
        self.tokenizer = WorkerTokenizer(self.worker, opened["tokenizer"])
        self.vocab_size = self._vocab_size()

    def generate(self, prompts: list, params: PromptParams) -> list:
        return [request_output(o) for o in self.worker.call("generate", list(prompts), params_payload(params))]

    def chat(self, conversations: list, params: PromptParams) -> list:
        return [request_output(o) for o in self.worker.call("chat", list(conversations), params_payload(params))]

    def score(self, prompts: list) -> list:
        return [score_output(o) for o in self.worker.call("score", list(prompts))]

    def info(self) -> dict:
        info = dict(self.worker.call("info"))
        info.setdefault("model_sha256", self.model_sha256)
        info.update(code_commit=self.code.commit, code_dirty=self.code.dirty_sha256 is not None,
                    code_dirty_sha256=self.code.dirty_sha256, code_ref=self.code.ref, code_label=self.code.label,
                    worker_pid=self.worker.proc.pid)
        return info

    def close(self) -> None:
        self.worker.close()
