"""Compile a Triton kernel for a GPU ahead of time (no GPU needed) and read what the compiler made of it.

``compile_for(fn, ...)`` builds the kernel the way the JIT would for one argument specialisation
(pointers and 16-divisible ints marked, unit strides as constants) for a CUDA capability (90: ``sm_90a``,
Hopper; 100: ``sm_100a``, Blackwell B200/GB200); ``kernel_stats(compiled)`` reads the cubin with the
``cuobjdump`` bundled in Triton's wheel: registers, stack (spill) bytes, shared memory, and from the SASS
which tensor-core MMA the kernel uses (Hopper's warp-group ``HGMMA``/``QGMMA``; Blackwell's tcgen05
``UTC*MMA``, whose accumulator lives in tensor memory and is read back with ``LDTM``), whether the
tensor-memory accelerator loads tiles (``UTMALDG``), and the instruction count and global loads of the
main loop (the innermost loop that issues MMAs).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

H100_SMEM_PER_BLOCK = 227 * 1024  # sm_90 opt-in limit per block (H100 / H200 / H800)
# Opt-in shared memory per block by compute capability (CUDA programming guide, "Technical Specifications"):
# sm_90 and sm_100 both allow 227 KB of their 228 KB per SM.
SMEM_PER_BLOCK = {90: H100_SMEM_PER_BLOCK, 100: 227 * 1024}
CAPABILITIES = tuple(SMEM_PER_BLOCK)  # the targets the compile gates cover


def check_capability(capability: int) -> int:
    """``capability`` if the compile gates cover it (90 = sm_90a, 100 = sm_100a), else a one-line ValueError."""
    if capability not in SMEM_PER_BLOCK:
        raise ValueError(f"capability must be one of {', '.join(map(str, CAPABILITIES))} (sm_90a Hopper, "
                         f"sm_100a Blackwell), got {capability!r}")
    return capability


@dataclass
class KernelStats:
    registers: int
    stack_bytes: int  # register spills (and local arrays) live here: 0 in a good kernel
    spill_stores: int  # STL instructions in the SASS
    smem_bytes: int
    wgmma: bool  # Hopper's warp-group MMA (HGMMA / QGMMA)
    tcgen05: bool  # Blackwell's tensor-core MMA (UTC*MMA, accumulator in tensor memory)
    tensor_core_mma: bool  # the architecture's tensor-core MMA: wgmma on sm_90, tcgen05 on sm_100
    tmem_loads: int  # LDTM in the SASS: tensor memory read back into registers (tcgen05 accumulators)
    block_scaled_mma: bool  # tcgen05.mma ... block_scale in the PTX: the MMA applies MX (1x32 UE8M0) scales itself
    tma: bool
    async_copies: bool  # global -> shared copies that run ahead of use (cp.async LDGSTS or TMA): pipelined loads
    loop_instructions: int  # SASS instructions in one iteration of the main loop (0: no MMA loop)
    loop_global_loads: int  # LDG / LDGSTS / UTMALDG in that loop body
    loop_mmas: int

    def as_dict(self) -> dict:
        return asdict(self)


def _triton_bin(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{name} is not bundled with this Triton ({path})")
    return str(path)


def compile_for(fn, pointers: dict[str, str], constexprs: dict[str, object], divisible: tuple[str, ...] = (),
                num_warps: int = 4, num_stages: int = 2, capability: int = 90, int_type: str = "i32"):
    """``triton.compile`` of ``fn`` (a ``@triton.jit`` function, or an autotuner wrapping one) for CUDA
    ``capability``: ``pointers`` maps pointer arguments to types (``"*bf16"``), ``constexprs`` gives
    constexpr (and constant-specialised) arguments, every other argument is an ``int_type`` scalar;
    the names in ``divisible`` are marked 16-divisible as the JIT does for aligned pointers and sizes."""
    import triton
    from triton.backends.compiler import GPUTarget

    check_capability(capability)
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    jit = fn
    while not isinstance(jit, JITFunction):  # autotuners (and heuristics) wrap the JITFunction
        jit = jit.fn
    names = list(jit.arg_names)
    unknown = (set(pointers) | set(constexprs) | set(divisible)) - set(names)
    if unknown:
        raise ValueError(f"compile_for: {jit.__name__} has no arguments {sorted(unknown)}")
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, int_type) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible if n not in constexprs}
    src = ASTSource(fn=jit, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _sass(cubin: bytes) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([_triton_bin("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([_triton_bin("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    return res, sass


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_MMA = re.compile(r"\b(HGMMA|QGMMA|HMMA|IMMA|UTC[A-Z0-9]*MMA)\b")
_TCGEN05 = re.compile(r"\bUTC[A-Z0-9]*MMA\b")
_WGMMA = re.compile(r"\b[HQ]GMMA\b")
_GLOBAL_LOAD = re.compile(r"\b(LDG|LDGSTS|UTMALDG)\b")


def _main_loop(sass: str) -> tuple[int, int, int]:
    """(instructions, global loads, MMAs) of the innermost loop that contains an MMA, from the SASS."""
    insns = [(int(a, 16), text) for a, text in _INSN.findall(sass)]
    addr_index = {a: i for i, (a, _) in enumerate(insns)}
    best = None
    for i, (addr, text) in enumerate(insns):
        m = re.search(r"\bBRA\b.*?`?\(?\.?L?_?x?_?(0x[0-9a-f]+)", text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= addr or target not in addr_index:
            continue
        body = [t for _, t in insns[addr_index[target]: i + 1]]
        mmas = sum(bool(_MMA.search(t)) for t in body)
        if mmas and (best is None or len(body) < len(best)):
            best = body
    if best is None:
        return 0, 0, 0
    return len(best), sum(bool(_GLOBAL_LOAD.search(t)) for t in best), sum(bool(_MMA.search(t)) for t in best)


def kernel_stats(compiled) -> KernelStats:
    """What ``cuobjdump`` says about a kernel compiled by ``compile_for``."""
    res, sass = _sass(compiled.asm["cubin"])

    def field(name: str) -> int:
        m = re.search(rf"\b{name}:(\d+)", res)
        return int(m.group(1)) if m else 0

    loop, loads, mmas = _main_loop(sass)
    wgmma, tcgen05 = bool(_WGMMA.search(sass)), bool(_TCGEN05.search(sass))
    return KernelStats(
        registers=field("REG"), stack_bytes=max(field("STACK"), field("LOCAL")),
        spill_stores=len(re.findall(r"\bSTL\b", sass)), smem_bytes=int(compiled.metadata.shared),
        wgmma=wgmma, tcgen05=tcgen05, tensor_core_mma=wgmma or tcgen05,
        tmem_loads=len(re.findall(r"\bLDTM\b", sass)),
        block_scaled_mma=bool(re.search(r"tcgen05\.mma\S*\.block_scale", compiled.asm.get("ptx", ""))),
        tma=bool(re.search(r"\bUTMALDG\b", sass)),
        async_copies=bool(re.search(r"\b(LDGSTS|UTMALDG)\b", sass)),
        loop_instructions=loop, loop_global_loads=loads, loop_mmas=mmas)
