"""Reading sm_70 SASS (nvdisasm text) into weighted instruction counts, for the V100 model.

A static model needs to know how often each instruction runs. This module turns one kernel's
SASS into instructions, a control-flow walk and a loop nest, so that `sass_model` can weight
every instruction by the trip counts of the loops around it:

- Reachability: from the entry, following fall-through and branch targets. `BRA.DIV` is taken
  as not taken and `CALL` targets are not followed (converged warps skip the warp-sync slow path),
  `@!PT` instructions never run, code after the last reachable EXIT (traps, slow paths) is cold.
- Loops: every reachable backward branch `source -> target` is a loop over [target, source].
- If/else diamonds (`@P BRA X` forward; `BRA Y` just before X): only the longer arm counts, a
  conservative choice (more work, a slower bound). One-armed ifs count as taken.
- Trip counts of counted loops are read from the SASS when the counter pattern is plain (an
  immediate start, an `IADD3 Rc, Rc, step` and an `ISETP.NE/LT ... Rc, bound` feeding the branch);
  other loops need a trip count from the launch shape.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_FUNC = re.compile(r"^\s*\.text\.(\S+):\s*$")
_LABEL = re.compile(r"^(\.L_x_\d+):\s*$")
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-6]\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass
class Instr:
    addr: int
    pred: str  # "" | "@P0" | "@!P1" | "@!PT" ...
    op: str  # full opcode with modifiers, e.g. "HMMA.884.F32.F32.STEP0"
    args: str
    target: int | None = None  # branch target address

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


@dataclass
class Loop:
    head: int  # first address of the body
    tail: int  # address of the backward branch
    depth: int = 0
    trips: float | None = None  # inferred from the SASS; None when the bound is a run-time value
    parent: int | None = None  # index of the enclosing loop

    def contains(self, addr: int) -> bool:
        return self.head <= addr <= self.tail


@dataclass
class Function:
    name: str
    instrs: list[Instr]
    loops: list[Loop] = field(default_factory=list)
    weight: dict[int, float] = field(default_factory=dict)  # addr -> 0/1 (reachable and on the counted arm)


def split_functions(sass: str) -> dict[str, list[Instr]]:
    """nvdisasm text -> {mangled kernel name: instructions}, branch targets resolved to addresses."""
    funcs: dict[str, list[Instr]] = {}
    labels: dict[str, int] = {}
    pending: list[str] = []
    current: list[Instr] | None = None
    for line in sass.splitlines():
        if m := _FUNC.match(line):
            current = funcs.setdefault(m.group(1), [])
            continue
        if current is None:
            continue
        if m := _LABEL.match(line.strip()):
            pending.append(m.group(1))
            continue
        if m := _INSTR.match(line):
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[f"{id(current)}:{lab}"] = addr
            pending = []
            current.append(Instr(addr, (m.group(2) or "").strip(), m.group(3), m.group(4)))
    for instrs in funcs.values():
        for pending_label, ins in ((t, ins) for ins in instrs for t in _TARGET.findall(ins.args)):
            ins.target = labels.get(f"{id(instrs)}:{pending_label}")
    return funcs


def _unconditional(ins: Instr) -> bool:
    return ins.pred in ("", "@PT")


def _reachable(instrs: list[Instr]) -> set[int]:
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    seen: set[int] = set()
    stack = [0] if instrs else []
    while stack:
        i = stack.pop()
        if i in seen or i >= len(instrs):
            continue
        seen.add(i)
        ins = instrs[i]
        if ins.pred == "@!PT":
            stack.append(i + 1)
            continue
        base, always = ins.base, _unconditional(ins)
        if base in ("EXIT", "RET") and always:
            continue
        if base == "BRA" and ".DIV" not in ins.op and ins.target is not None:
            stack.append(index[ins.target])
            if always:
                continue
        stack.append(i + 1)
    return {instrs[i].addr for i in seen}


def _diamond_weights(instrs: list[Instr], live: set[int]) -> dict[int, float]:
    weight = {ins.addr: (1.0 if ins.addr in live and ins.pred != "@!PT" else 0.0) for ins in instrs}
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    for i, ins in enumerate(instrs):
        if ins.addr not in live or ins.base != "BRA" or _unconditional(ins) or ".DIV" in ins.op:
            continue
        if ins.target is None or ins.target <= ins.addr:
            continue
        x = index[ins.target]
        before = instrs[x - 1]
        if before.base == "BRA" and _unconditional(before) and ".DIV" not in before.op \
                and before.target is not None and before.target > ins.target:
            y = index[before.target]
            then_arm, else_arm = range(i + 1, x - 1), range(x, y)
            shorter = then_arm if len(then_arm) < len(else_arm) else else_arm
            for j in shorter:
                weight[instrs[j].addr] = 0.0
    return weight


_COUNTER_STEP = re.compile(r"^(R\d+), (R\d+), (0x[0-9a-f]+|\d+), RZ$")
_SETP = re.compile(r"^(P[0-6]), PT, (R\d+), (0x[0-9a-f]+|\d+), PT$")


def _imm(text: str) -> int:
    return int(text, 16) if text.startswith("0x") else int(text)


def _infer_trips(instrs: list[Instr], loop: Loop, branch: Instr) -> float | None:
    """Trip count of `for (c = start; c != bound; c += step)` as ptxas lays it out, else None."""
    pred = branch.pred.lstrip("@")
    if pred.startswith("!"):
        return None
    body = [ins for ins in instrs if loop.contains(ins.addr)]
    setp = next((ins for ins in reversed(body) if ins.base == "ISETP" and (m := _SETP.match(ins.args))
                 and m.group(1) == pred and (".NE." in ins.op or ".LT." in ins.op)), None)
    if setp is None:
        return None
    m = _SETP.match(setp.args)
    counter, bound = m.group(2), _imm(m.group(3))
    step = None
    for ins in body:
        s = _COUNTER_STEP.match(ins.args)
        if ins.base == "IADD3" and s and s.group(1) == counter and s.group(2) == counter:
            step = _imm(s.group(3))
    if not step:
        return None
    start = None
    for ins in instrs:
        if ins.addr >= loop.head:
            break
        a = ins.args
        if a.startswith(counter + ","):
            start = None  # written by something we cannot read
            if ins.op in ("MOV", "IMAD.MOV.U32") and (a == f"{counter}, RZ" or a == f"{counter}, RZ, RZ, RZ"):
                start = 0
            elif ins.op == "MOV" and (mm := re.match(rf"^{counter}, (0x[0-9a-f]+|\d+)$", a)):
                start = _imm(mm.group(1))
            elif ins.op == "IMAD.MOV.U32" and (mm := re.match(rf"^{counter}, RZ, RZ, (0x[0-9a-f]+|\d+)$", a)):
                start = _imm(mm.group(1))
        elif ins.op == "CS2R" and a.startswith(f"{counter}, SRZ"):
            start = 0
    if start is None or bound <= start:
        return None
    return float(-(-(bound - start) // step))


def analyse(name: str, instrs: list[Instr]) -> Function:
    """Reachability, diamonds and the loop nest of one kernel."""
    live = _reachable(instrs)
    fn = Function(name, instrs, weight=_diamond_weights(instrs, live))
    loops: list[Loop] = []
    for ins in instrs:
        if ins.addr in live and ins.base == "BRA" and ".DIV" not in ins.op and ins.target is not None \
                and ins.target <= ins.addr:
            if ins.target == ins.addr:
                continue  # the trailing self-branch after EXIT
            loop = Loop(ins.target, ins.addr)
            loop.trips = _infer_trips(instrs, loop, ins)
            loops.append(loop)
    loops.sort(key=lambda lp: (lp.head, -lp.tail))
    for i, lp in enumerate(loops):
        parents = [j for j in range(len(loops)) if j != i and loops[j].head <= lp.head and lp.tail <= loops[j].tail
                   and (loops[j].head, loops[j].tail) != (lp.head, lp.tail)]
        if parents:
            lp.parent = max(parents, key=lambda j: (loops[j].head, -loops[j].tail))
    for lp in loops:
        d, p = 0, lp.parent
        while p is not None:
            d, p = d + 1, loops[p].parent
        lp.depth = d
    fn.loops = loops
    return fn


def innermost_loop(fn: Function, addr: int) -> int | None:
    """Index of the deepest loop holding `addr`, or None outside every loop."""
    best = None
    for i, lp in enumerate(fn.loops):
        if lp.contains(addr) and (best is None or lp.depth > fn.loops[best].depth):
            best = i
    return best
