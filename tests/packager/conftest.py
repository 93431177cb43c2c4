"""Fixtures of the packager's tests."""

from pathlib import Path

import pytest


@pytest.fixture
def fake_transformers(monkeypatch):
    """transformers' GGUF reading replaced by objects that save one file each (no gguf package needed)."""
    import transformers

    from packager import gguf_convert

    class Saved:
        def save_pretrained(self, folder):
            (Path(folder) / f"{type(self).__name__}.json").write_text("{}")

    class Tokenizer(Saved):
        pass

    class Model(Saved):
        pass

    monkeypatch.setattr(gguf_convert, "_check_sizes", lambda *a: None)  # it reads the file with gguf
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Tokenizer())
    # as convert_gguf loads it (output_loading_info): with its loading info, no tensor missing or mismatched
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: (Model(), {"missing_keys": set(), "mismatched_keys": set()}))
