"""The revision worker: one process per arm that imports the onecat engine of one source tree and serves
the harness's requests for it. Run as a script by gates/revision/client.py, never imported: it imports
nothing of onecat but the engine, and that from the tree it was given.

    python worker.py --import-root ROOT --engine-dir DIR --fd N

ROOT (gates/revision/worktrees.import_root) goes first on sys.path; the worker then checks that
`onecat.engine` was loaded from DIR (not from the editable install or an installed wheel) and refuses
otherwise. Protocol, over the socket at file descriptor N (multiprocessing.connection framing: one
length-prefixed pickle per message, plain data only, so the harness rebuilds outputs with its own classes):

    worker -> ("ready", {"engine_dir", "python"})      or ("error", {...}) and exit
    harness -> (op, args) for op in open / generate / chat / score / tokenizer / info / close
    worker -> ("ok", result, seconds) or ("error", {"type", "message", "traceback"}, seconds)

    open(settings, template_kwargs) -> {"info", "tokenizer": its plain attributes}
    generate(prompts, params) / chat(conversations, params) -> [RequestOutput as nested dicts]
    score(prompts) -> [ScoreOutput as dicts];  tokenizer(method, args, kwargs) -> its result
    info() -> engine info;  close() -> None, then the worker exits
params: one dict or a list of dicts of SamplingParams fields that differ from the harness's defaults.
"""
import argparse
import dataclasses
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

TOKENIZER_METHODS = ("encode", "decode", "token_to_id", "id_to_token", "apply_chat_template")
OPS = ("open", "generate", "chat", "score", "tokenizer", "info", "close")


def plain(value):
    """Dataclasses (outputs, timings, counts) as dicts, recursively; everything else as it is."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


class Served:
    """The engine of this tree behind the protocol's operations."""

    def __init__(self):
        from onecat.engine import SamplingParams
        from onecat.engine.llm import LLM

        self.LLM, self.SamplingParams = LLM, SamplingParams
        self.llm, self.template_kwargs = None, {}

    def params(self, params):
        if isinstance(params, list):
            return [self.SamplingParams(**p) for p in params]
        return self.SamplingParams(**params)

    def open(self, settings, template_kwargs):
        self.llm, self.template_kwargs = self.LLM(**settings), dict(template_kwargs)
        tok = self.llm.tokenizer
        attrs = {k: v for k, v in vars(tok).items()
                 if not k.startswith("_") and isinstance(v, (str, int, float, bool, list, type(None)))}
        return {"info": self.llm.info(), "tokenizer": attrs}

    def generate(self, prompts, params):
        return plain(self.llm.generate(prompts, self.params(params)))

    def chat(self, conversations, params):
        return plain(self.llm.chat(conversations, self.params(params), **self.template_kwargs))

    def score(self, prompts):
        return plain(self.llm.score(prompts))

    def tokenizer(self, method, args, kwargs):
        if method not in TOKENIZER_METHODS:
            raise AttributeError(f"tokenizer method {method!r} is not served; served: {TOKENIZER_METHODS}")
        return getattr(self.llm.tokenizer, method)(*args, **kwargs)

    def info(self):
        return self.llm.info()

    def close(self):
        if self.llm is not None:
            self.llm.close()


def error_reply(exc):
    return ("error", {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()})


def import_engine(import_root, engine_dir):
    """Import onecat.engine from `import_root`; refuse an engine loaded from anywhere but `engine_dir`."""
    sys.path.insert(0, import_root)
    import onecat.engine

    loaded = Path(onecat.engine.__file__).resolve().parent
    if loaded != Path(engine_dir).resolve():
        raise ImportError(f"onecat.engine was imported from {loaded}, not from {engine_dir} (another onecat on "
                          f"sys.path won); refusing to run the wrong code")
    return Served()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--import-root", required=True)
    parser.add_argument("--engine-dir", required=True)
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args()
    del sys.path[0]  # this script's folder (the harness's gates/revision) must not shadow anything
    conn = Connection(args.fd)
    try:
        served = import_engine(args.import_root, args.engine_dir)
    except BaseException as exc:  # noqa: BLE001 - reported to the harness, which names the revision
        conn.send(error_reply(exc))
        return 1
    conn.send(("ready", {"engine_dir": args.engine_dir, "python": sys.executable, "pid": os.getpid()}))
    while True:
        try:
            op, op_args = conn.recv()
        except EOFError:  # the harness is gone
            served.close()
            return 0
        t0 = time.perf_counter()
        try:
            if op not in OPS:
                raise ValueError(f"unknown operation {op!r}; operations: {OPS}")
            reply = ("ok", getattr(served, op)(*op_args))
        except BaseException as exc:  # noqa: BLE001 - the harness raises it on its side
            reply = error_reply(exc)
        conn.send(reply + (time.perf_counter() - t0,))
        if op == "close":
            return 0


if __name__ == "__main__":
    sys.exit(main())
