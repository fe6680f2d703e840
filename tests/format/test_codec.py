"""The state codec: exact round trips (property-based and a real ResNet-18 training state), and
the refusals of everything it cannot store."""

from __future__ import annotations

import json
import math
import random
import struct
from collections import OrderedDict

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptsdk import open_backend
from ckptsdk.errors import CorruptCheckpointError, ManifestError, UnsupportedStateError
from ckptsdk.format.codec import decode, encode
from ckptsdk.format.dtype import TABLE, DType, to_torch
from ckptsdk.format.files.tensorfile import read_tensorfile, write_tensorfile
from ckptsdk.format.skeleton import tensor_paths
from ckptsdk.state import TrainState


def through_files(tree):
    """encode -> strict JSON -> safetensors bytes -> decode, as a checkpoint would go."""
    tensors, skeleton = encode(tree)
    text = json.dumps(skeleton, allow_nan=False)
    # safetensors wants contiguous, unshared tensors; the real writer copies values the same way.
    blob = safetensors.torch.save({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()})
    return decode(json.loads(text), safetensors.torch.load(blob))


def assert_same(a, b, path="root"):
    """Exact equality: types, dtypes, shapes, values bit for bit (nan payloads and -0.0 too)."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert _bytes(a.detach().cpu()) == _bytes(b.detach().cpu()), f"{path}: values differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and np.array(a).tobytes() == np.array(b).tobytes(), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()) or _keys_same(a, b), f"{path}: keys differ"
        assert [type(k) for k in a] == [type(k) for k in b], f"{path}: key types differ"
        for (ka, va), vb in zip(a.items(), b.values(), strict=True):
            assert_same(va, vb, f"{path}/{ka!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _keys_same(a, b):  # nan keys are never == each other
    return all(
        struct.pack("<d", x) == struct.pack("<d", y) if isinstance(x, float) else x == y
        for x, y in zip(a, b, strict=True)
    )


def _bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


# --- property tests ---------------------------------------------------------------------------

TORCH_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
NP_DTYPES = [
    np.float64,
    np.float32,
    np.float16,
    np.int64,
    np.int32,
    np.int8,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.bool_,
    np.complex64,
    ">f4",
    ">i8",
]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = math.prod(shape)
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    if dtype == torch.bool:
        raw = bytes(b & 1 for b in raw)  # other bytes are not valid bools
    t = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
        if n
        else torch.empty(shape, dtype=dtype)
    )
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous view
    return t


@st.composite
def arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(NP_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    n = math.prod(shape)
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    if dtype.kind == "b":
        raw = bytes(b & 1 for b in raw)
    a = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if draw(st.booleans()) and a.ndim >= 1:
        a = a[::-1]  # negative strides
    return a


@st.composite
def np_scalars(draw):
    dtype = np.dtype(draw(st.sampled_from(NP_DTYPES)))
    raw = draw(st.binary(min_size=dtype.itemsize, max_size=dtype.itemsize))
    if dtype.kind == "b":
        raw = bytes([raw[0] & 1])
    return np.frombuffer(raw, dtype=dtype)[0]


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**200), 2**200)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from([-0.0, float("nan"), -float("nan"), 2**63, -(2**63) - 1])
)
keys = (
    st.text(max_size=6)
    | st.sampled_from(["/", "a/b", "%2F", "0", "-1", "#x", "$tensor", "__metadata__", ""])
    | st.integers(-3, 300)
    | st.booleans()
    | st.none()
    | st.floats(allow_nan=False)
)
leaves = scalars | tensors() | arrays() | np_scalars()
trees = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(keys, children, max_size=4)
        | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees)
def test_random_trees_round_trip_exactly(tree):
    assert_same(tree, through_files(tree))


@settings(max_examples=60, deadline=None, database=None)
@given(trees)
def test_tensor_paths_are_unique_and_listed_by_the_skeleton(tree):
    tensors, skeleton = encode(tree)
    assert tensor_paths(skeleton) == list(tensors)
    assert "__metadata__" not in tensors  # safetensors' reserved header key


# --- specific cases ---------------------------------------------------------------------------


def test_skeleton_format_is_readable_and_documented():
    t = torch.zeros(2, 3)
    tensors, skeleton = encode({"objects": {"model": {"w": t}}, "opt": {"state": {0: {"m": t}}}, "t": (1, 2.5, None)})
    assert skeleton == {
        "objects": {"model": {"w": {"$tensor": "objects/model/w", "dtype": "float32", "shape": [2, 3]}}},
        "opt": {"state": {"$dict": [[0, {"m": {"$tensor": "opt/state/0/m", "dtype": "float32", "shape": [2, 3]}}]]}},
        "t": {"$tuple": [1, 2.5, None]},
    }
    assert tensors["objects/model/w"] is not None and list(tensors) == ["objects/model/w", "opt/state/0/m"]


def test_paths_escape_slashes_and_separate_int_from_str_keys():
    tree = {
        "a/b": torch.ones(1),
        "a": {"b": torch.ones(1)},
        0: torch.ones(1),
        "0": torch.ones(1),
        None: torch.ones(1),
        "#None": torch.ones(1),
        2**70: torch.ones(1),
        "%2F": torch.ones(1),
    }
    tensors, _ = encode(tree)
    assert sorted(tensors) == sorted(["a%2Fb", "a/b", "0", "%30", "#None", "%23None", "#0x400000000000000000", "%252F"])


def test_special_values_and_types_survive():
    tree = {
        "nan": float("nan"),
        "inf": math.inf,
        "ninf": -math.inf,
        "negzero": -0.0,
        "big": 2**100,
        "negbig": -(2**64),
        "bool": True,
        "int": 1,
        "float": 1.0,
        "np32": np.float32(0.1),
        "np64": np.int64(-5),
        "npbool": np.bool_(False),
        "npnan": np.float32("nan"),
        "u64": np.uint64(2**64 - 1),
        "c": np.complex64(1 - 2j),
        "zero_d": torch.tensor(3, dtype=torch.int64),
        "empty": torch.empty(0, 5),
        "np0d": np.array(2.5),
        "bf16": torch.randn(3, generator=torch.Generator().manual_seed(0)).bfloat16(),
        # False, not True: True == 1, so {1: .., True: ..} is one key and no bool key got tested.
        "mixed": {1: "a", "1": "b", None: 0, False: 1.5, 2.5: [], "$x": ()},
    }
    back = through_files(tree)
    assert_same(tree, back)
    assert type(back["bool"]) is bool and type(back["np32"]) is np.float32
    assert isinstance(back["np0d"], np.ndarray) and back["np0d"].shape == ()


def test_random_getstate_loads_back_into_setstate():
    random.seed(7)
    np.random.seed(7)
    back = through_files(
        {"py": random.getstate(), "np": np.random.get_state(), "np_dict": np.random.get_state(legacy=False)}
    )
    expected = [random.random() for _ in range(3)], np.random.rand(3).tolist()
    random.setstate(back["py"])
    np.random.set_state(back["np"])
    assert ([random.random() for _ in range(3)], np.random.rand(3).tolist()) == expected
    np.random.set_state(back["np_dict"])
    assert np.random.rand(3).tolist() == expected[1]


def test_encode_does_not_copy_and_keeps_views():
    base = torch.arange(12.0).reshape(3, 4)
    tree = {"view": base.t(), "same": base, "row": base[1], "param": torch.nn.Parameter(base)}
    tensors, _ = encode(tree)
    assert tensors["same"].data_ptr() == base.data_ptr()
    assert tensors["view"].data_ptr() == base.data_ptr() and not tensors["view"].is_contiguous()
    assert tensors["row"].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert type(tensors["param"]) is torch.Tensor and not tensors["param"].requires_grad
    arr = np.arange(4.0)
    assert encode({"a": arr})[0]["a"].data_ptr() == arr.ctypes.data
    back = through_files(tree)  # sharing is not preserved: values are
    assert torch.equal(back["view"], base.t()) and torch.equal(back["row"], base[1])
    assert type(back["param"]) is torch.Tensor


def test_conjugate_and_negative_views_store_their_values():
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    back = through_files({"conj": c.conj()})
    assert torch.equal(back["conj"], torch.tensor([1 - 2j, 3 + 1j], dtype=torch.complex64))


@pytest.mark.parametrize("entry", TABLE, ids=lambda d: d.name)
def test_every_dtype_a_tensor_file_holds_round_trips_through_the_codec(entry: DType):
    # One dtype table (ckptsdk/format/dtype.py): what the tensor file writes, the codec stores.
    dtype = to_torch(entry)
    if dtype is None:
        pytest.skip(f"torch {torch.__version__} has no {entry.name}")
    raw = torch.arange(3 * 4 * dtype.itemsize, dtype=torch.uint8) * 37  # every byte value kind
    t = (raw & 1 if dtype == torch.bool else raw).view(dtype).reshape(3, 4)
    tree = {"t": t, "view": t.t()}
    tensors, skeleton = encode(tree)
    assert skeleton["t"]["dtype"] == entry.name
    backend = open_backend(f"memory://codec-dtype-{entry.name}")
    size, digest = write_tensorfile(backend, "t.safetensors", tensors)
    back = decode(
        json.loads(json.dumps(skeleton, allow_nan=False)),
        read_tensorfile(backend, "t.safetensors", size=size, digest=digest),
    )
    assert_same(tree, back)


@pytest.mark.parametrize(
    ("tree", "path", "type_name", "hint"),
    [
        ({"sched": {"fn": lambda s: s}}, "sched/fn", "function", "recreate it in code"),
        ({"a": [1, {2, 3}]}, "a/1", "set", "sorted list"),
        ({"b": b"xy"}, "b", "bytes", "uint8 tensor"),
        ({"o": object()}, "o", "object", "leave it out of state_dict()"),
        ({"arr": np.array([1, "a"], dtype=object)}, "arr", "numpy.ndarray", "dtype object"),
        ({"d": {(1, 2): 3}}, "d/(1, 2)", "tuple", "dict keys must be str, int"),
        ({"c": torch.zeros(2, dtype=torch.complex128)}, "c", "torch.Tensor", "view_as_real"),
        ({"s": torch.zeros(3).to_sparse()}, "s", "torch.Tensor", "to_dense"),
        ({"x": {"y": np.str_("s")}}, "x/y", "numpy.str_", "numpy scalars of dtype"),
        ({"od": __import__("collections").defaultdict(lambda: 0)}, "od", "collections.defaultdict", "default_factory"),
        ({"od": __import__("collections").UserDict()}, "od", "collections.UserDict", "leave it out"),
        (torch.nn.Linear(2, 2), "<root>", "torch.nn.modules.linear.Linear", "state_dict()"),
    ],
)
def test_unsupported_leaves_name_path_type_and_fix(tree, path, type_name, hint):
    with pytest.raises(UnsupportedStateError) as info:
        encode(tree)
    assert info.value.path == path
    assert info.value.type_name == type_name
    assert path in str(info.value) and type_name in str(info.value) and hint in str(info.value)


def test_lazy_parameters_are_refused_with_a_hint():
    lazy = torch.nn.LazyLinear(3)
    with pytest.raises(UnsupportedStateError, match="forward pass") as info:
        encode({"m": lazy.state_dict()})
    assert info.value.path == "m/weight"


def test_cycles_are_refused_not_recursed_forever():
    loop: list = [1]
    loop.append(loop)
    with pytest.raises(UnsupportedStateError, match="cycle") as info:
        encode({"l": loop})
    assert info.value.path == "l/1"


def test_decode_reports_missing_or_mismatched_tensors_and_bad_skeletons():
    tensors, skeleton = encode({"w": torch.ones(2, 2)})
    with pytest.raises(CorruptCheckpointError, match="'w'") as info:
        decode(skeleton, {})
    assert info.value.key == "w"
    with pytest.raises(CorruptCheckpointError, match="shape"):
        decode(skeleton, {"w": torch.ones(4)})
    with pytest.raises(CorruptCheckpointError, match="float64"):
        decode(skeleton, {"w": torch.ones(2, 2, dtype=torch.float64)})
    for bad in [
        {"$nope": 1},
        {"$tuple": 3},
        {"$dict": [[1]]},
        {"$float": "zero"},
        {"$int": "12"},
        {"$tensor": "w", "dtype": "float32"},
        {"$tensor": "w", "dtype": "complex128", "shape": [2, 2]},
        {"$npscalar": "<f4", "hex": "00"},
        float("nan"),
        {"$dict": [[[1], 2]]},
        {"$npscalar": "|O", "value": 1},
        {"$ndarray": "w", "dtype": "<U3", "shape": [2, 2]},
        {"$state_dict": [], "metadata": {}},
        {"$tensor": "w", "dtype": "float32", "shape": [2, 2], "x": 1},
    ]:
        with pytest.raises(ManifestError):
            decode(bad, tensors)


# --- the real thing: ResNet-18 + SGD + OneCycleLR + GradScaler + RNGs ----------------------------


def _job():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
    scaler = torch.amp.GradScaler("cpu")
    return model, opt, sched, scaler


def _step(model, opt, sched, scaler):
    x = torch.randn(4, 3, 16, 16)  # draws from the global RNG on purpose: its state must resume
    y = torch.from_numpy(np.random.randint(0, 10, size=4)).long()
    noise = random.random()
    loss = torch.nn.functional.cross_entropy(model(x), y) * (1 + noise)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    return loss.item()


def test_module_state_dict_keeps_its_version_metadata():
    sd = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).state_dict()
    tensors, skeleton = encode({"m": sd})
    # _metadata is an OrderedDict itself: kept as one, like every OrderedDict
    assert skeleton["m"]["metadata"]["$ordered_dict"]["1"] == {"version": 2}  # BatchNorm's version
    assert list(skeleton["m"]["$state_dict"]) == list(sd) and list(tensors)[0] == "m/0.weight"
    back = through_files({"m": sd})["m"]
    assert type(back) is OrderedDict and back._metadata == sd._metadata
    assert_same(sd, back)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic reductions, and fair to the other tests on 2 cores
    yield
    torch.set_num_threads(threads)


def test_resnet18_training_state_round_trips_and_resumes_identically(one_thread):
    job = _job()
    for _ in range(2):
        _step(*job)
    model, opt, sched, scaler = job
    state = TrainState(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    tree = state.state_dict()
    saved = through_files(tree)
    assert_same(tree["objects"]["optimizer"], saved["objects"]["optimizer"])
    assert_same(tree["objects"]["scheduler"], saved["objects"]["scheduler"])
    assert_same(tree["objects"]["scaler"], saved["objects"]["scaler"])
    assert_same(tree["rng"], saved["rng"])
    assert_same(tree["objects"]["model"], saved["objects"]["model"])
    assert saved["objects"]["model"]._metadata == tree["objects"]["model"]._metadata  # module versions
    # Go on from here (the reference), then load the checkpoint into a fresh job and do the same.
    reference = [_step(*job) for _ in range(2)]
    reference_weights = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = _job()
    TrainState(model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], scaler=fresh[3]).load_state_dict(saved)
    resumed = [_step(*fresh) for _ in range(2)]
    assert resumed == reference
    for key, value in fresh[0].state_dict().items():
        assert torch.equal(value, reference_weights[key]), key
    assert fresh[2].get_last_lr() == sched.get_last_lr()
