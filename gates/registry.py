"""Name -> class registries for the harness's plug-in points, filled by decorators.

Adding a workload kind, a gate check, an engine backend or a dataset is one new file under the
matching folder (gates/runners/, gates/checks/, gates/engines/, gates/datasets/) plus one decorator
line; `load_plugins()` imports every module in those folders so the decorators run.

    @register_runner("my_kind")          # class with a pydantic `Workload` (kind: Literal["my_kind"])
    @register_check("my_check")          # class with a pydantic `Config`  (check: Literal["my_check"])
    @register_engine("my_backend")       # class with classmethod open(arm_settings) -> engine adapter
    register_dataset(DatasetSpec(...))   # gates/datasets/catalog.py

Workload schemas can also be declared without a runner (`declare_workload_schema`), so a contract
that names a kind whose runner ships later still validates; `gate run` refuses it up front.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable, TypeVar

T = TypeVar("T")

ENGINES: dict[str, type] = {}
RUNNERS: dict[str, type] = {}
CHECKS: dict[str, type] = {}
DATASETS: dict[str, Any] = {}  # name -> gates.datasets.spec.DatasetSpec
# kind -> pydantic model of the workload config; a registered runner's `Workload` wins over a
# schema declared ahead of its runner.
WORKLOAD_SCHEMAS: dict[str, type] = {}


class RegistryError(LookupError):
    """A name that no registered plug-in answers to; the message lists the names that exist."""


def _decorator(table: dict[str, type], what: str, name: str, after: Callable[[type], None] | None = None):
    def wrap(cls: type[T]) -> type[T]:
        existing = table.get(name)
        if existing is not None and existing is not cls and (
                existing.__module__, existing.__qualname__) != (cls.__module__, cls.__qualname__):
            raise RegistryError(f"{what} {name!r} is registered twice: {existing.__module__}."
                                f"{existing.__qualname__} and {cls.__module__}.{cls.__qualname__}")
        table[name] = cls
        cls.registry_name = name
        if after:
            after(cls)
        return cls
    return wrap


def register_engine(name: str):
    return _decorator(ENGINES, "engine", name)


def register_runner(kind: str):
    def schema(cls: type) -> None:
        workload = getattr(cls, "Workload", None)
        if workload is None:
            raise RegistryError(f"runner {cls.__qualname__} for kind {kind!r} has no nested "
                                "pydantic `Workload` class")
        WORKLOAD_SCHEMAS[kind] = workload
        cls.kind = kind
    return _decorator(RUNNERS, "runner", kind, schema)


def register_check(name: str):
    def config(cls: type) -> None:
        if getattr(cls, "Config", None) is None:
            raise RegistryError(f"check {cls.__qualname__} ({name!r}) has no nested pydantic `Config` class")
    return _decorator(CHECKS, "check", name, config)


def declare_workload_schema(kind: str, schema: type) -> None:
    """Accept `kind` in contracts before its runner exists (a registered runner replaces it)."""
    if kind not in RUNNERS:
        WORKLOAD_SCHEMAS[kind] = schema


def register_dataset(spec: Any) -> Any:
    if spec.name in DATASETS and DATASETS[spec.name] != spec:
        raise RegistryError(f"dataset {spec.name!r} is registered twice with different pins")
    DATASETS[spec.name] = spec
    return spec


def lookup(table: dict[str, Any], what: str, name: str) -> Any:
    load_plugins()
    if name not in table:
        known = ", ".join(sorted(table)) or "(none)"
        broken = "".join(f"; note: {m} failed to import ({e})" for m, e in PLUGIN_ERRORS.items())
        raise RegistryError(f"unknown {what} {name!r}; registered: {known}{broken}")
    return table[name]


_loaded = False
PLUGIN_ERRORS: dict[str, str] = {}  # module -> import error, shown instead of hiding a broken plug-in


def load_plugins() -> None:
    """Import every module in gates/{engines,runners,checks,datasets} once, running their decorators.

    A module that fails to import is recorded in PLUGIN_ERRORS (and named in lookup errors) so one
    broken plug-in does not take the whole harness down.
    """
    global _loaded
    if _loaded:
        return
    _loaded = True
    for package in ("engines", "datasets", "runners", "checks"):
        pkg = importlib.import_module(f"onecat.gates.{package}")
        for info in pkgutil.iter_modules(pkg.__path__):
            if info.name.startswith("_"):
                continue
            module = f"onecat.gates.{package}.{info.name}"
            try:
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - reported, not swallowed
                PLUGIN_ERRORS[module] = f"{type(exc).__name__}: {exc}"
