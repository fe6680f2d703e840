"""What save() commits, restore reads (issue 47, item 4): every limit a manifest reader enforces
(its size, its JSON depth, Python's int-to-text limit) is enforced when a save is asked for, with
a CkptError and nothing written; otherwise a fresh reader reads back exactly what was saved.

The limits are lowered (``limits`` and ``Manifest.MAX_BYTES`` together) so that examples stay
small; one test keeps the real 64 MiB and saves the 70 MB tag of the report.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ckptsdk import CheckpointManager
from ckptsdk.backends import open_backend
from ckptsdk.checkpoint.reading.reader import CheckpointReader
from ckptsdk.errors import CkptError, ConfigError, UnsupportedStateError
from ckptsdk.format import limits
from ckptsdk.format.manifest import Manifest
from tests.format.test_codec import assert_same, trees

_SMALL = {"MANIFEST_BYTES": 256 << 10, "TREE_BYTES": 192 << 10, "USER_BYTES": 16 << 10}


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in _SMALL.items():
        monkeypatch.setattr(limits, name, value)
    monkeypatch.setattr(Manifest, "MAX_BYTES", _SMALL["MANIFEST_BYTES"])


class Blob:
    """A user object whose state holds one str (a tokenizer's vocabulary, a config dump)."""

    def __init__(self, text: str = "") -> None:
        self.text = text

    def state_dict(self) -> dict[str, str]:
        return {"text": self.text}

    def load_state_dict(self, sd: dict[str, str]) -> None:
        self.text = sd["text"]


def _written(root: str, step: int) -> list[str]:
    return [o.key for o in open_backend(root).list("") if o.key.startswith(f"step-{step:010d}")]


def _reader(root: str) -> CheckpointReader:
    return CheckpointReader(open_backend(root))  # its own memo: parses what is on storage


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("where", ["tag", "extra", "state"])
def test_a_save_a_reader_would_refuse_is_refused_before_it_writes(tmp_path, small_limits, where, blocking):
    root = str(tmp_path / "run")
    big = "x" * (300 << 10)  # over the (lowered) manifest limit on its own
    with CheckpointManager(root, keep_last=5, async_save=True) as mgr:
        mgr.save({"w": torch.ones(2), "blob": Blob("small").state_dict()}, step=1, blocking=True)
        state = {"w": torch.ones(2), "blob": Blob(big if where == "state" else "small").state_dict()}
        with pytest.raises(CkptError) as caught:
            mgr.save(
                state,
                step=2,
                tags={"vocab": big} if where == "tag" else None,
                extra={"vocab": big} if where == "extra" else None,
                blocking=blocking,
            )
        assert isinstance(caught.value, UnsupportedStateError if where == "state" else ConfigError)
        assert "manifest" in str(caught.value) and "bytes" in str(caught.value)
        assert _written(root, 2) == []
        mgr.save({"w": torch.ones(2), "blob": Blob("ok").state_dict()}, step=3, blocking=True)  # it goes on
    assert [c.step for c in _reader(root).list() if c.valid] == [1, 3]


def test_the_reported_70mb_tag_is_refused_at_save(tmp_path):
    root = str(tmp_path / "run")
    with CheckpointManager(root, keep_last=2) as mgr:
        with pytest.raises(ConfigError, match="tags"):
            mgr.save({"w": torch.ones(2)}, step=1, tags={"vocab": "x" * (70 << 20)})
    assert _written(root, 1) == []


def test_too_deep_extra_and_tree_are_refused(tmp_path):
    root = str(tmp_path / "run")
    deep: object = 1
    for _ in range(260):
        deep = [deep]
    nested: object = 1
    for _ in range(150):  # 150 path levels, 300 JSON levels: pydantic refuses it at parse
        nested = (nested,)
    with CheckpointManager(root, keep_last=2) as mgr:
        with pytest.raises(ConfigError, match="nests 261 levels"):
            mgr.save({"w": torch.ones(1)}, step=1, extra={"deep": deep})
        with pytest.raises(UnsupportedStateError, match="JSON levels"):
            mgr.save({"w": torch.ones(1), "t": nested}, step=2)
        mgr.save({"w": torch.ones(1), "t": [[[[1]]]]}, step=3, extra={"ok": [[1]]})
    assert _written(root, 1) == _written(root, 2) == []
    assert _reader(root).latest().step == 3


def test_ints_no_reader_can_parse_are_refused(tmp_path):
    root = str(tmp_path / "run")
    with CheckpointManager(root, keep_last=2) as mgr:
        with pytest.raises(ConfigError, match="4,300 digits"):
            mgr.save({"w": torch.ones(1)}, step=1, extra={"n": 10**5000})
    assert _written(root, 1) == []


def test_a_template_capture_is_held_to_the_limit_too(tmp_path, small_limits):
    # The second save goes through the cached template: the bound must still catch it.
    root = str(tmp_path / "run")
    blob = Blob("a")
    with CheckpointManager(root, keep_last=5) as mgr:
        mgr.save({"blob": blob.state_dict(), "w": torch.zeros(1)}, step=1)
        blob.text = "\U0001f600" * (20 << 10)  # 20 Ki chars, 240 KiB of \\u escapes
        with pytest.raises(UnsupportedStateError, match="blob/text"):
            mgr.save({"blob": blob.state_dict(), "w": torch.zeros(1)}, step=2)
        blob.text = "b" * (100 << 10)  # under the limit as plain ASCII: saved
        mgr.save({"blob": blob.state_dict(), "w": torch.zeros(1)}, step=3)
    assert _reader(root).load(3)["blob"]["text"] == "b" * (100 << 10)


# --- the property: refused at save, or read back equal ---------------------------------------

_CHARS = st.sampled_from(["a", '"', "\\", "\x00", "\u00e9", "\U0001f600", "\udc80"])
_SIZES = st.sampled_from([0, 1, 100, 5 << 10, 15 << 10, 17 << 10, 64 << 10, 200 << 10, 300 << 10])
big_strings = st.builds(lambda c, n: c * n, _CHARS, _SIZES)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**63, -(2**63) - 1, 10**400, float("nan"), float("inf"), -0.0])  # 10**5000: its own test
    | st.floats()
    | st.text(max_size=5)
    | big_strings
)


def _nest(value: object, depth: int) -> object:
    for _ in range(depth):
        value = [value]
    return value


json_values = st.recursive(
    json_scalars,
    lambda kids: (
        st.lists(kids, max_size=3)
        | st.dictionaries(st.text(max_size=4).filter(lambda k: not k.startswith("$")), kids, max_size=3)
    ),
    max_leaves=8,
)
extras = st.dictionaries(
    st.text(max_size=4).filter(lambda k: not k.startswith("$")),
    json_values | st.builds(_nest, json_values, st.sampled_from([0, 50, 190, 210, 260])),
    max_size=3,
)
tag_maps = st.dictionaries(st.text(max_size=4), st.text(max_size=4) | big_strings, max_size=3)
state_trees = st.fixed_dictionaries(
    {
        "w": st.just(torch.arange(3.0)),
        "t": trees,
        "s": big_strings,
        "deep": st.builds(lambda d: _nest((1,), d), st.sampled_from([0, 60, 98, 99, 120])),
    }
)


@settings(
    max_examples=30,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(state=state_trees, extra=extras, tags=tag_maps, data=st.data())
def test_refused_at_save_or_read_back_equal(tmp_path_factory, small_limits, state, extra, tags, data):
    root = str(tmp_path_factory.mktemp("limits") / "run")
    blocking = data.draw(st.booleans(), label="blocking")
    with CheckpointManager(root, keep_last=2, async_save=True) as mgr:
        try:
            mgr.save(state, step=7, extra=extra, tags=tags, metrics={"loss": 0.5}, blocking=blocking)
            mgr.wait()
        except CkptError as exc:
            event(f"refused: {type(exc).__name__}")
            assert _written(root, 7) == []
            return
    event("read back")
    reader = _reader(root)
    info = reader.latest()
    assert info is not None and info.step == 7, "save() committed what no reader reads"
    manifest = reader.load_manifest(7)
    assert_same(dict(manifest.position.extra), extra)
    assert manifest.tags == tags
    assert_same(reader.load(7), state)
