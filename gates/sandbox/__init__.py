"""Run untrusted Python (generated code) in an isolated, resource-limited subprocess."""

from onecat.gates.sandbox.capture import Channel
from onecat.gates.sandbox.limits import SandboxLimits
from onecat.gates.sandbox.run import SandboxResult, SandboxUnavailable, probe_isolation, run_python

__all__ = ["Channel", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "probe_isolation", "run_python"]
