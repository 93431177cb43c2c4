"""The committed generated code matches what `make proto` produces from proto/ now."""

from pathlib import Path

from pipecast.protogen import ROOT, generate


def test_generated_code_is_current(tmp_path):
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in generate(tmp_path)}
    assert fresh, "no generated files"
    for rel, content in fresh.items():
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is not committed: run `make proto`"
        assert committed.read_bytes() == content, f"{rel} is stale: run `make proto`"
    stale = {p.relative_to(ROOT) for p in (ROOT / "pipecast" / "v1").glob("*_pb2*.py*")} - set(fresh)
    assert not stale, f"generated files without a proto: {sorted(map(str, stale))}"
    assert Path(ROOT / "pipecast" / "v1" / "__init__.py").exists()
