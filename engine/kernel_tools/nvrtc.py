"""Minimal ctypes binding of NVRTC: CUDA C++ source -> PTX, with lowered kernel names."""
from __future__ import annotations

import ctypes
from pathlib import Path


class NvrtcError(RuntimeError):
    pass


class Nvrtc:
    def __init__(self, lib_path: Path):
        # The builtins library sits beside libnvrtc; load it first so dlopen finds it.
        for builtins in sorted(lib_path.parent.glob("libnvrtc-builtins.so.*")):
            if ".alt." not in builtins.name:
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def _check(self, rc: int, what: str, log: str = "") -> None:
        if rc != 0:
            msg = self.lib.nvrtcGetErrorString(rc).decode()
            raise NvrtcError(f"{what} failed: {msg}\n{log}")

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def compile(self, source: str, name: str, options: list[str],
                name_expressions: list[str]) -> tuple[str, dict[str, str]]:
        """Returns (ptx, {name expression: lowered (mangled) name})."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                                0, None, None), "nvrtcCreateProgram")
        try:
            for expr in name_expressions:
                self._check(self.lib.nvrtcAddNameExpression(prog, expr.encode()), f"add name {expr}")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            rc = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            log_size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
            log_buf = ctypes.create_string_buffer(log_size.value)
            self.lib.nvrtcGetProgramLog(prog, log_buf)
            self._check(rc, "NVRTC compile", log_buf.value.decode(errors="replace"))
            ptx_size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size)), "nvrtcGetPTXSize")
            ptx_buf = ctypes.create_string_buffer(ptx_size.value)
            self._check(self.lib.nvrtcGetPTX(prog, ptx_buf), "nvrtcGetPTX")
            lowered: dict[str, str] = {}
            for expr in name_expressions:
                out = ctypes.c_char_p()
                self._check(self.lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)),
                            f"lowered name of {expr}")
                lowered[expr] = out.value.decode()
            return ptx_buf.value.decode(), lowered
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
