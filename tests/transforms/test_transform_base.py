"""The transform interface (shardfeed/transforms/base.py): the prepared arrays' encoding, the per-sample
generator, loading a factory, the output check and apply()."""

import sys
import textwrap

import numpy as np
import pytest

from shardfeed.transforms import (
    Output, Transform, TransformError, apply, checked, describe, fields_read, load, pack, rng_for, unpack,
)


# pack / unpack

def test_pack_round_trips_arrays_of_every_shape_and_order():
    arrays = {
        "image": np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
        "label": np.array(7, dtype=np.int64),                    # 0-d stays 0-d
        "big": np.arange(5, dtype=">f4"),                         # big-endian in, little-endian out
        "empty": np.zeros((0, 3), dtype=np.float32),
        "strided": np.arange(20, dtype=np.int16).reshape(4, 5)[:, ::2],
    }
    got = unpack(pack(arrays))
    assert list(got) == list(arrays)
    for name, array in arrays.items():
        assert got[name].shape == array.shape, name
        assert got[name].dtype == array.dtype.newbyteorder("<"), name
        np.testing.assert_array_equal(got[name], array)
    assert got["label"].ndim == 0 and int(got["label"]) == 7
    assert got["big"].dtype.byteorder in ("<", "=")


def test_unpack_gives_read_only_views_of_the_payload():
    payload = pack({"x": np.arange(4, dtype=np.uint8)})
    got = unpack(payload)["x"]
    assert not got.flags.writeable and got.base is not None


def test_pack_of_nothing_round_trips():
    assert unpack(pack({})) == {}


@pytest.mark.parametrize("payload", [
    b"", b"garbage", b"SFP1" + b"\xff" * 4, b"XXXX\x02\x00\x00\x00[]",
    pack({"x": np.arange(4, dtype=np.uint8)})[:-1],              # truncated
    pack({"x": np.arange(4, dtype=np.uint8)}) + b"\0",           # trailing bytes
])
def test_unpack_refuses_what_pack_did_not_make(payload):
    with pytest.raises(TransformError, match="not a prepared payload"):
        unpack(payload)


def test_pack_refuses_object_arrays():
    with pytest.raises(TransformError, match="Python objects"):
        pack({"x": np.array([object()], dtype=object)})


# rng_for

def test_rng_for_is_the_same_generator_for_the_same_triple():
    a = rng_for(3, 1, 42).integers(0, 1 << 62, size=8)
    b = rng_for(3, 1, 42).integers(0, 1 << 62, size=8)
    np.testing.assert_array_equal(a, b)


def test_rng_for_differs_when_any_of_seed_epoch_index_differs():
    draws = {triple: tuple(rng_for(*triple).integers(0, 1 << 62, size=4))
             for triple in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 2, 3), (3, 2, 1), (2**64 - 1, 0, 0)]}
    assert len(set(draws.values())) == len(draws)


def test_rng_for_takes_large_numbers():
    rng_for(2**70, 2**40, 10**12).random()


# load

FACTORIES = textwrap.dedent('''
    import numpy as np
    from shardfeed.transforms import Output, Transform

    class Good(Transform):
        outputs = {"x": Output("uint8", (None,))}

    def good():
        return Good()

    def not_a_transform():
        return {"x": 1}

    class NoOutputs(Transform):
        pass

    def no_outputs():
        return NoOutputs()

    class BadName(Transform):
        outputs = {"Bad-Name": Output("uint8")}

    def bad_name():
        return BadName()

    class NotAnOutput(Transform):
        outputs = {"x": ("uint8", ())}

    def not_an_output():
        return NotAnOutput()

    instance = Good()
''')


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    folder = tmp_path_factory.mktemp("factories")
    (folder / "sf_test_factories.py").write_text(FACTORIES)
    sys.path.insert(0, str(folder))
    yield "sf_test_factories"
    sys.path.remove(str(folder))
    sys.modules.pop("sf_test_factories", None)


def test_load_calls_the_factory_or_takes_an_instance(factories):
    assert type(load(f"{factories}:good")).__name__ == "Good"
    assert type(load(f"{factories}:instance")).__name__ == "Good"
    assert describe(load(f"{factories}:good")) == {"version": "1", "fields": None,
                                                   "outputs": {"x": {"dtype": "uint8", "shape": [None]}}}


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "expected package.module:factory"),
    (":factory", "expected package.module:factory"),
    ("module:", "expected package.module:factory"),
    ("sf_no_such_module_here:f", "cannot import 'sf_no_such_module_here'"),
])
def test_load_refuses_a_bad_spec_or_a_missing_module(spec, message):
    with pytest.raises(TransformError, match=message):
        load(spec)


@pytest.mark.parametrize("attribute, message", [
    ("missing", "has no 'missing'"),
    ("not_a_transform", "returned dict, not a shardfeed.transforms.Transform"),
    ("no_outputs", "declares no outputs"),
    ("bad_name", r"output name 'Bad-Name' is not \[a-z0-9_\]"),
    ("not_an_output", "output 'x' is not an Output"),
])
def test_load_refuses_what_is_not_a_transform(factories, attribute, message):
    with pytest.raises(TransformError, match=message):
        load(f"{factories}:{attribute}")


# Output, checked and apply

class Pair(Transform):
    outputs = {"image": Output("uint8", (3, None, None)), "label": Output("int64", ())}


@pytest.mark.parametrize("dtype, shape", [("not_a_dtype", ()), ("O", ()), ("uint8", (-1,)), ("uint8", (2.0,))])
def test_output_refuses_a_bad_declaration(dtype, shape):
    with pytest.raises(TransformError):
        Output(dtype, shape)


def test_checked_accepts_variable_dimensions_and_orders_the_outputs():
    got = checked(Pair(), {"label": np.int64(3), "image": np.zeros((3, 5, 7), np.uint8), "extra": np.zeros(1)})
    assert list(got) == ["image", "label"]
    assert got["image"].shape == (3, 5, 7) and got["label"].shape == ()
    assert checked(Pair(), {"image": np.zeros((3, 1, 2), np.uint8), "label": np.array(1)})["image"].shape == (3, 1, 2)


def test_checked_makes_big_endian_and_strided_arrays_little_and_contiguous():
    class Floats(Transform):
        outputs = {"x": Output(">f4", (2, 2))}

    array = np.arange(8, dtype=">f4").reshape(2, 4)[:, ::2]
    got = checked(Floats(), {"x": array})["x"]
    assert got.flags.c_contiguous and got.dtype.str == "<f4"
    np.testing.assert_array_equal(got, array)


@pytest.mark.parametrize("arrays, message", [
    ({"image": np.zeros((3, 2, 2), np.uint8)}, "returned no 'label'"),
    ({}, "returned no 'image', 'label'"),
    ({"image": np.zeros((3, 2, 2), np.float32), "label": np.int64(1)}, "'image' is float32, declared uint8"),
    ({"image": np.zeros((4, 2, 2), np.uint8), "label": np.int64(1)}, r"'image' has shape \(4, 2, 2\)"),
    ({"image": np.zeros((3, 2), np.uint8), "label": np.int64(1)}, r"'image' has shape \(3, 2\)"),
    ({"image": np.zeros((3, 2, 2), np.uint8), "label": np.zeros(1, np.int64)}, r"'label' has shape \(1,\)"),
])
def test_checked_names_what_differs(arrays, message):
    with pytest.raises(TransformError, match=message):
        checked(Pair(), arrays)


class Noisy(Transform):
    """Adds the generator's draw to its input in place, as an augment may."""

    outputs = {"x": Output("int64", (4,))}

    def augment(self, prepared, rng):
        prepared["x"] += rng.integers(0, 1000, size=4)
        return prepared


def test_apply_never_writes_into_the_prepared_arrays():
    prepared = {"x": np.arange(4, dtype=np.int64)}
    first = apply(Noisy(), prepared, seed=1, epoch=0, index=5)
    np.testing.assert_array_equal(prepared["x"], np.arange(4))
    np.testing.assert_array_equal(apply(Noisy(), prepared, seed=1, epoch=0, index=5)["x"], first["x"])
    assert not np.array_equal(apply(Noisy(), prepared, seed=1, epoch=1, index=5)["x"], first["x"])


def test_apply_works_on_read_only_unpacked_arrays():
    prepared = unpack(pack({"x": np.arange(4, dtype=np.int64)}))
    got = apply(Noisy(), prepared, seed=0, epoch=0, index=0)["x"]
    np.testing.assert_array_equal(got - np.arange(4), rng_for(0, 0, 0).integers(0, 1000, size=4))


def test_apply_checks_the_outputs():
    class Wrong(Transform):
        outputs = {"x": Output("uint8", (2,))}

        def augment(self, prepared, rng):
            return {"x": np.zeros(3, np.uint8)}

    with pytest.raises(TransformError, match="shape"):
        apply(Wrong(), {}, 0, 0, 0)


# fields_read

def test_a_transform_reads_the_declared_fields_the_dataset_has():
    assert fields_read(("jpg", "jpeg", "png", "webp", "cls"), ["cls", "jpg"]) == ["jpg", "cls"]  # declared order
    assert fields_read(("jpg", "cls"), ["cls"]) == ["cls"]
    assert fields_read(("jpg", "png"), ["bin", "cls"]) == ["jpg", "png"]  # none: all, so the read names them
    assert fields_read(None, ["bin"]) is None
