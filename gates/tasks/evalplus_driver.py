"""The program that runs inside the sandbox for EvalPlus: call a solution on every test input.

It only *computes* outputs; the harness compares them with the reference outputs itself, so a
hostile solution cannot report a pass it did not earn (it never sees the expected outputs; the
threat model is in evalplus_protocol.py). Reads spec.json (this task's inputs only) from its
scratch dir, hardens (candidate mode), then writes one JSON line per input on the result channel,
fd 3 (the sandbox's pipe to the harness): {"set", "i", "status": ok|error|timeout, "out", "t"},
after a {"event": "load"} line. The solution's own prints go nowhere (fd 1 is /dev/null).
Per-input time limits are enforced with a repeating SIGALRM (EvalPlus's time_limit) and rechecked
against the measured time, so a solution that swallows the alarm still times out.
Stdlib only; its source is prepended with gates/tasks/pyvalues.py before it is sent in.
"""

DRIVER_SOURCE = r'''
import copy, io, os, signal, sys, time

if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)


class _SandboxTimeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _SandboxTimeout()


class _Swallow(io.TextIOBase):
    def write(self, s):
        return len(s)

    def writable(self):
        return True

    def readable(self):
        return False

    def read(self, *a):
        raise IOError("stdin is closed in the sandbox")

    readline = read


def _describe(exc):
    text = f"{type(exc).__name__}: {exc}"
    return text[:300]


def _main():
    with open("spec.json", "r", encoding="utf-8") as fh:
        spec = json.load(fh)
    out_fd = 3
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    write = os.write
    perf = time.perf_counter
    setitimer = signal.setitimer
    deepcopy = copy.deepcopy

    def emit(obj):
        setitimer(signal.ITIMER_REAL, 0)  # no alarm may cut a message short
        data = memoryview((json.dumps(obj, allow_nan=False) + "\n").encode("utf-8"))
        while data:  # a pipe write can be partial
            data = data[write(out_fd, data):]

    sets = [(name, [decode_value(x) for x in spec["inputs"][name]], spec["time_limits"][name])
            for name in spec["order"]]
    signal.signal(signal.SIGALRM, _on_alarm)
    if spec["mode"] == "candidate":
        sandbox_harden()
    sys.stdout = sys.stderr = sys.stdin = _Swallow()
    globs = {}
    try:
        setitimer(signal.ITIMER_REAL, spec["load_time_limit"], 0.1)
        exec(compile(spec["code"], "solution.py", "exec"), globs)
        setitimer(signal.ITIMER_REAL, 0)
        fn = globs[spec["entry_point"]]
    except _SandboxTimeout:
        emit({"event": "load", "status": "timeout"})
        return
    except BaseException as exc:
        setitimer(signal.ITIMER_REAL, 0)
        emit({"event": "load", "status": "error", "error": _describe(exc)})
        return
    emit({"event": "load", "status": "ok"})
    not_none = spec["output_not_none"]
    for name, inputs, limits in sets:
        for i, inp in enumerate(inputs):
            args = deepcopy(inp)
            limit = limits[i] if limits else 0.0
            try:
                if limit:
                    setitimer(signal.ITIMER_REAL, limit, 0.1)
                t0 = perf()
                out = fn(*args)
                dt = perf() - t0
                setitimer(signal.ITIMER_REAL, 0)
            except _SandboxTimeout:
                emit({"set": name, "i": i, "status": "timeout"})
                return
            except BaseException as exc:
                setitimer(signal.ITIMER_REAL, 0)
                emit({"set": name, "i": i, "status": "error", "error": _describe(exc)})
                return
            if limit and dt > limit:
                emit({"set": name, "i": i, "status": "timeout", "t": dt})
                return
            if not_none:
                out = out is not None
            try:
                encoded = encode_result(out)
            except BaseException:
                encoded = {"__opaque__": "unencodable", "repr": ""}
            emit({"set": name, "i": i, "status": "ok", "out": encoded, "t": dt})
    emit({"event": "done"})


try:
    _main()
except BaseException as _exc:
    import traceback
    os.write(2, ("driver failed: " + "".join(traceback.format_exception(_exc))[-2000:]).encode("utf-8", "replace"))
    os._exit(3)
'''


def driver_program() -> str:
    """Full source of the sandbox program: the value codec followed by the driver."""
    from pathlib import Path

    codec = (Path(__file__).with_name("pyvalues.py")).read_text(encoding="utf-8")
    return codec + "\n" + DRIVER_SOURCE
