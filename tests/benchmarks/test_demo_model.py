"""The demo model's cached package (no GGUF needed: a tiny checkpoint stands in for the converted one)."""

from packager.manifest import read_manifest
from packager.pack import pack
from benchmarks import demo_model
from benchmarks.tiny_checkpoints import make_checkpoint


def test_a_cached_package_cut_otherwise_than_the_default_is_packed_again(tmp_path, caplog):
    """The benchmarks measured the cached package whatever its cut: one packed by an older default (8 blocks) went
    on being measured after the default changed."""
    checkpoint = make_checkpoint("llama", tmp_path / "checkpoints" / demo_model.MODEL_NAME)
    out = tmp_path / "packages" / demo_model.MODEL_NAME
    old = pack(checkpoint, out, layers_per_block=2, model_name=demo_model.MODEL_NAME)
    assert len(old.blocks) < old.num_layers

    assert demo_model.demo_package(tmp_path) == out
    again = read_manifest(out)
    assert [(b.layer_start, b.layer_end) for b in again.blocks] == [(i, i + 1) for i in range(old.num_layers)]
    assert "packing SmolLM2-135M-Instruct again" in caplog.text

    caplog.clear()
    assert demo_model.demo_package(tmp_path) == out  # cut by the default: used as it is
    assert read_manifest(out).package_id == again.package_id
    assert "again" not in caplog.text
