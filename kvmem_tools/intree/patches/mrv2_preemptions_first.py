"""[Bugfix][Model Runner V2] Call ``handle_preemptions`` before new blocks are
written.

``KVConnectorBase_V1.handle_preemptions`` is documented to run before
preempted or evicted blocks are overwritten, and the V1 runner calls it
before ``_update_states``. Model Runner V2 calls it from ``pre_forward``,
after ``update_requests`` has zeroed the step's new blocks and applied its
copy-on-write copies, so a connector that still reads such a block (an async
store of a preempted request, a late spill) reads zeros or another block's
KV. The call moves to the start of ``update_requests``.
"""

from kvmem_tools.intree.edits import Edit, appended
from kvmem_tools.intree.pr_text import Answer, pr_text
from kvmem_tools.intree.series import FILES, InTreePatch

SLUG = "mrv2_preemptions_first"
RUNNER = "vllm/v1/worker/gpu/model_runner.py"
CONNECTOR = "vllm/v1/worker/gpu/kv_connector.py"
TEST = "tests/v1/worker/test_gpu_kv_connector.py"
TEST_NAME = "test_preemptions_are_handled_before_update_requests_writes"

MESSAGE = pr_text(
    overview="""\
Model Runner V2 calls the KV connector's `handle_preemptions` after
`update_requests` has written the step's new blocks: it zeroes
`new_block_ids_to_zero` (hybrid models, fp8 KV) and applies
`kv_cache_block_copies` (copy-on-write of partial prefix hits) first, and
only then does `pre_forward` call `handle_preemptions`. The hook's contract
(`KVConnectorBase_V1.handle_preemptions`: "BEFORE they are overwritten") and
the V1 runner (before `_update_states`) put it first. This PR calls it at the
start of `update_requests`, before those writes, so both runners give
connectors the same order.
""",
    claims=[
        (
            "On Model Runner V2, `handle_preemptions` runs before the step zeroes "
            "its new blocks and applies its copy-on-write copies, as on V1."
        ),
        "It runs once per step, as before (no longer from `pre_forward`).",
        "Runners and connectors that do not override the hook are unaffected.",
    ],
    validation=f"""\
- `pytest {TEST} -k {TEST_NAME}`: 1 passed (CPU build of vLLM 0.32.0 and
  0.33.0). It runs V2's real `update_requests` on a stand-in for the
  runner's GPU state (no GPU here): the connector's `handle_preemptions`
  comes before the zeroing and the copy-on-write copy, and `pre_forward` no
  longer calls it. It fails on the current order. The file's existing
  tests now expect no `handle` from `pre_forward` and `no_forward`; the
  whole file passes (4 tests on 0.32.0, 5 on 0.33.0).
- Not run on a GPU: an engine check under V2 with a connector that reads
  evicted blocks in `handle_preemptions` is for the submitter's CUDA run.
""",
    details="""\
Which connectors it matters to: any whose `handle_preemptions` still reads a
block the scheduler has handed to another request. `OffloadingConnector`
waits there for async stores of preempted requests' blocks;
`SimpleCPUOffloadConnector` syncs its in-flight transfers there. Under V2,
with zeroing or copy-on-write in the same step, those stores can read the
overwritten block.

The call sits in `update_requests` rather than `execute_model` because the
encoder-only runner (`mm_encoder_model_runner.py`) calls `update_requests`
as well and reaches the connector only through `no_forward`.
""",
    duplicates="""\
searched open vLLM PRs for "handle_preemptions" and "Model Runner V2" KV
connector ordering in the stored PR corpus: none moves this call. The `gh`
searches of AGENTS.md are for the submitter to rerun before opening.
""",
    design_fit=Answer(
        True, "A call moved within Model Runner V2; no connector API change."
    ),
    testing=Answer(
        False,
        "Unit tests only, on CPU; no CUDA engine run yet (no GPU was available).",
    ),
    code_quality=Answer(True, "One comment says why the call comes first."),
    contents=Answer(True, "Root cause, the hook's contract and V1's order cited."),
)

_BASE_ANCHOR = '''\
class KVConnector:
    """KVConnector interface used by GPUModelRunner."""

'''

_BASE_HOOK = """\
    def handle_preemptions(self, scheduler_output: "SchedulerOutput") -> None:
        pass

"""

_ACTIVE_ANCHOR = """\
        self._pending_load_kwargs: dict[str, Any] | None = None
        self._disabled = False

"""

_ACTIVE_HOOK = '''\
    def handle_preemptions(self, scheduler_output: "SchedulerOutput") -> None:
        """Before the step writes its new blocks: the connector may still read
        blocks of preempted requests or blocks evicted from the prefix cache."""
        if self._disabled:
            return
        kv_connector_metadata = scheduler_output.kv_connector_metadata
        assert kv_connector_metadata is not None
        self.kv_connector.handle_preemptions(kv_connector_metadata)

'''

_PRE_FORWARD_CALL = """\
        self.kv_connector.handle_preemptions(kv_connector_metadata)
        self.kv_connector.bind_connector_metadata(kv_connector_metadata)
"""

_BIND_CALL = """\
        self.kv_connector.bind_connector_metadata(kv_connector_metadata)
"""

_ZEROING = """\
        # Zero GPU memory for freshly allocated cache blocks to prevent
"""

_RUNNER_CALL = """\
        # Before the zeroing and copy-on-write below (and the forward) write
        # new blocks, as the connector API promises.
        self.kv_connector.handle_preemptions(scheduler_output)

"""


_TEST_IMPORTS = (
    "import numpy as np\n",
    "import vllm.v1.worker.gpu.model_runner as v2_runner\n",
    "from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy\n"
    "from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput\n",
)
#: The file's check that pre_forward hands preemptions over, as vLLM has it
#: and without them.
_PRE_FORWARD_EVENTS = (
    "    assert events == (\n"
    '        ["handle", "bind", "start"] if has_sync_kv_loads else ["handle", "bind"]\n'
    "    )\n"
)
_PRE_FORWARD_EVENTS_NOW = (
    '    assert events == (["bind", "start"] if has_sync_kv_loads else ["bind"])\n'
)


def _changes(release: str) -> list:
    waits = ["clear"] if release == "0.32" else ["results", "clear"]
    tail = ", ".join(f'"{w}"' for w in waits)
    handle_first = [
        Edit(
            TEST,
            "    connector.post_forward(set())\n"
            f'    assert events == ["handle", "bind", "start", "wait", {tail}]\n',
            "    connector.post_forward(set())\n"
            f'    assert events == ["bind", "start", "wait", {tail}]\n',
            where="replace",
        ),
        Edit(
            TEST,
            "    connector.no_forward(_scheduler_output(False))\n\n"
            f'    assert events == ["handle", "bind", "start", "wait", {tail}]\n',
            "    connector.no_forward(_scheduler_output(False))\n\n"
            f'    assert events == ["bind", "start", "wait", {tail}]\n',
            where="replace",
        ),
        Edit(TEST, _PRE_FORWARD_EVENTS, _PRE_FORWARD_EVENTS_NOW, where="replace"),
    ]
    if release == "0.33":
        handle_first += [
            Edit(
                TEST,
                '    assert events == ["handle", "bind", "start", "results"]\n',
                '    assert events == ["bind", "start", "results"]\n',
                where="replace",
            ),
            Edit(
                TEST,
                '["handle", "bind", "start", "results", "wait", "clear"]',
                '["bind", "start", "results", "wait", "clear"]',
                where="replace",
            ),
        ]
    return [
        Edit(CONNECTOR, _BASE_ANCHOR, _BASE_HOOK),
        Edit(CONNECTOR, _ACTIVE_ANCHOR, _ACTIVE_HOOK),
        Edit(CONNECTOR, _PRE_FORWARD_CALL, _BIND_CALL, where="replace"),
        Edit(RUNNER, _ZEROING, _RUNNER_CALL, where="before"),
        Edit(TEST, "import pytest\n", _TEST_IMPORTS[0], where="before"),
        Edit(
            TEST,
            "import vllm.v1.worker.gpu.kv_connector as kv_connector_module\n",
            _TEST_IMPORTS[1],
        ),
        Edit(
            TEST,
            "from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector\n",
            _TEST_IMPORTS[2],
            where="before",
        ),
        *handle_first,
        appended(TEST, FILES / SLUG / "appended" / TEST),
    ]


PATCH = InTreePatch(
    slug=SLUG,
    subject="[Bugfix][Model Runner V2] Connector preemptions first",
    message=MESSAGE,
    changes={"0.32": _changes("0.32"), "0.33": _changes("0.33")},
)
