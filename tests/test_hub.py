"""Models and drafters by Hugging Face Hub id (jaxspec/loading/hub.py), against a loopback server
that answers the Hub's endpoints the way huggingface_hub calls them: the listing
(`/api/models/{id}/revision/{rev}`, `.../tree/{rev}`) and the file endpoint
(`/{id}/resolve/{rev}/{file}`: HEAD with X-Repo-Commit / ETag / X-Linked-Size, GET with Range).
HF_ENDPOINT points at it and HF_HOME is a temporary directory; the server logs every request, so
the tests can say which files were (not) requested."""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import threading
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from conftest import make_tiny_checkpoint, save_byte_tokenizer

from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError
from jaxspec.loading import hub, load_model
from jaxspec.loading.registry import resolve

PROMPTS = [[5, 6, 7, 8], [200, 3]]


# ---- the loopback Hub ---------------------------------------------------------------------------


class FakeHub:
    """Repos of {commit: {file: bytes}} with refs (branch/tag -> commit); every request is logged
    as (method, repo-relative path, Range header)."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.cut: dict[str, int] = {}  # file -> bytes sent before the connection is cut (once)
        self.refuse_after_cut = False  # then answer 503 to that file until healed
        self.lock = threading.Lock()
        hub_ = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 10  # a stuck client frees its thread (bounded waits)

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub_.answer(self, head=True)

            def do_GET(self):
                hub_.answer(self, head=False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo: str, files: dict[str, bytes], *, ref="main", commit=None, gated=False):
        repo_ = self.repos.setdefault(repo, {"commits": {}, "refs": {}, "gated": gated})
        commit = commit or hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
        repo_["commits"][commit] = files
        repo_["refs"][ref] = commit
        return commit

    def files_requested(self) -> list[str]:
        return [p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p, _ in self.requests
                if m == "GET" and "/resolve/" in p]

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    # ---- answers ----

    def answer(self, h, head: bool):
        url = urllib.parse.urlsplit(h.path)
        path = urllib.parse.unquote(url.path)
        with self.lock:
            self.requests.append((h.command, path, h.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            return self.api(h, parts[2:])
        if len(parts) >= 5 and parts[2] == "resolve":
            return self.resolve(h, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), head)
        return self.error(h, 404, "RepoNotFound")

    def commit_of(self, repo: str, rev: str) -> str | None:
        r = self.repos[repo]
        return rev if rev in r["commits"] else r["refs"].get(rev)

    def api(self, h, parts):
        repo = "/".join(parts[:2])
        if repo not in self.repos:
            return self.error(h, 401, "RepoNotFound")  # the Hub's answer to unknown and private
        rev = parts[3] if len(parts) > 3 else "main"
        commit = self.commit_of(repo, rev)
        if commit is None:
            return self.error(h, 404, "RevisionNotFound")
        files = self.repos[repo]["commits"][commit]
        if len(parts) > 2 and parts[2] == "tree":
            body = [{"type": "file", "path": n, "size": len(b), "oid": _sha1(b)}
                    | ({"lfs": {"oid": _sha256(b), "size": len(b), "pointerSize": 134}}
                       if _lfs(n) else {})
                    for n, b in sorted(files.items())]
        else:
            body = {"id": repo, "sha": commit, "private": False,
                    "gated": "manual" if self.repos[repo]["gated"] else False,
                    "siblings": [{"rfilename": n, "size": len(b), "blobId": _sha1(b)}
                                 | ({"lfs": {"size": len(b), "sha256": _sha256(b),
                                             "pointerSize": 134}} if _lfs(n) else {})
                                 for n, b in sorted(files.items())]}
        self.send(h, 200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def resolve(self, h, repo, rev, name, head):
        if repo not in self.repos:
            return self.error(h, 401, "RepoNotFound")
        if self.repos[repo]["gated"]:
            return self.error(h, 401, "GatedRepo", "Access to model is restricted.")
        commit = self.commit_of(repo, rev)
        if commit is None:
            return self.error(h, 404, "RevisionNotFound")
        files = self.repos[repo]["commits"][commit]
        if name not in files:
            return self.error(h, 404, "EntryNotFound")
        data = files[name]
        etag = _sha256(data) if _lfs(name) else _sha1(data)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if _lfs(name):
            headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))}
        if head:
            return self.send(h, 200, b"", headers | {"Content-Length": str(len(data))}, body=False)
        if name in self.cut:
            sent = self.cut.pop(name)
            h.send_response(200)
            for k, v in (headers | {"Content-Length": str(len(data))}).items():
                h.send_header(k, v)
            h.send_header("Connection", "close")
            h.end_headers()
            h.wfile.write(data[:sent])
            h.wfile.flush()
            h.close_connection = True
            if self.refuse_after_cut:
                self.cut_refused = name
            return None
        if getattr(self, "cut_refused", None) == name:
            return self.error(h, 503, None, "try later")
        start = 0
        if h.headers.get("Range"):
            start = int(h.headers["Range"].split("=")[1].split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self.send(h, 206 if start else 200, data[start:], headers)

    def error(self, h, status, code, message=None):
        headers = {"X-Error-Code": code} if code else {}
        if message:
            headers["X-Error-Message"] = message
        self.send(h, status, json.dumps({"error": message or code}).encode(), headers)

    @staticmethod
    def send(h, status, data, headers, body=True):
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        if "Content-Length" not in headers:
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body and h.command != "HEAD":  # a HEAD answer has headers only
            h.wfile.write(data)


def _lfs(name: str) -> bool:
    return name.endswith((".safetensors", ".gguf", ".bin"))


def _sha1(b: bytes) -> str:
    return hashlib.sha1(b).hexdigest()


def _sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    server = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    yield server
    server.close()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A sharded tiny Llama (index + shards) with a byte tokenizer: what a Hub repo holds."""
    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("hub_tiny"), "llama", seed=7, max_shard_size="40KB",
        tie_word_embeddings=False,
    )
    return save_byte_tokenizer(path)


@pytest.fixture(scope="module")
def tiny_dir_v1(tmp_path_factory):
    """Another commit of the same repo: other weights (one file)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hub_tiny_v1"), "llama", seed=8)


def greedy(model) -> list[list[int]]:
    return [r.token_ids for r in Engine(model).generate(PROMPTS, max_new_tokens=6, batch_size=2)]


# ---- tests --------------------------------------------------------------------------------------


def test_a_model_by_id_generates_what_the_local_files_do(fake_hub, tiny_dir, monkeypatch, capsys):
    files = files_of(tiny_dir) | {"pytorch_model.bin": b"pickle", "modeling_x.py": b"import os",
                                  "README.md": b"# tiny"}
    commit = fake_hub.add("org/tiny", files)
    monkeypatch.setenv("JAXSPEC_PROGRESS", "1")
    by_id = load_model("org/tiny")
    err = capsys.readouterr().err
    assert "downloading org/tiny" in err and "B/s" in err  # progress: bytes and rate, on stderr
    fetched = fake_hub.files_requested()
    assert "pytorch_model.bin" not in fetched and "modeling_x.py" not in fetched
    assert "README.md" not in fetched
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= set(fetched)
    assert len(set(fetched)) == len(fetched)  # each file once
    assert by_id.revision == commit and Path(by_id.source_path).name == commit
    assert by_id.tokenizer is not None
    local = load_model(tiny_dir)
    assert local.revision == ""
    results = Engine(by_id).generate(PROMPTS, max_new_tokens=6, batch_size=2)
    assert [r.token_ids for r in results] == greedy(local)
    assert results[0].metrics["model_revision"] == commit


def test_offline_with_the_model_cached_makes_no_request(fake_hub, tiny_dir, monkeypatch):
    fake_hub.add("org/tiny", files_of(tiny_dir))
    online = resolve("org/tiny")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(fake_hub.requests)
    offline = load_model("org/tiny")
    assert len(fake_hub.requests) == before
    assert offline.revision == online.revision and offline.source_path == str(online.path)
    with pytest.raises(JaxspecError, match="HF_HUB_OFFLINE is set and org/other is not .*`hf "
                       "download org/other`"):
        load_model("org/other")
    assert len(fake_hub.requests) == before


def test_a_revision_pins_the_commit(fake_hub, tiny_dir, tiny_dir_v1):
    old = fake_hub.add("org/tiny", files_of(tiny_dir_v1), ref="v1")
    new = fake_hub.add("org/tiny", files_of(tiny_dir), ref="main")
    assert old != new
    pinned = resolve("org/tiny@v1")
    assert pinned.revision == old
    assert (pinned.path / "model.safetensors").read_bytes() == (
        tiny_dir_v1 / "model.safetensors").read_bytes()
    assert resolve("org/tiny").revision == new
    assert resolve(f"org/tiny@{old}").revision == old  # a commit id pins too
    with pytest.raises(JaxspecError, match="org/tiny has no revision 'v9': use a branch, tag"):
        resolve("org/tiny@v9")


def test_a_repo_with_only_pickles_is_refused_before_any_file(fake_hub):
    fake_hub.add("org/pickled", {"config.json": b"{}", "pytorch_model.bin": b"\x80\x04pickle"})
    with pytest.raises(JaxspecError, match="org/pickled has only pickled weights "
                       r"\(pytorch_model.bin\), which jaxspec never downloads"):
        load_model("org/pickled")
    assert [m for m, p, _ in fake_hub.requests if "/resolve/" in p] == []


def test_gated_and_unknown_repos_say_what_to_do(fake_hub, tiny_dir):
    fake_hub.add("meta/gated", files_of(tiny_dir), gated=True)
    with pytest.raises(JaxspecError, match=r"meta/gated is gated or private \(HTTP 401\): accept "
                       rf"its license at {fake_hub.url}/meta/gated and set HF_TOKEN"):
        load_model("meta/gated")
    with pytest.raises(JaxspecError, match="no model org/nothing on the Hub .*HF_TOKEN"):
        load_model("org/nothing")
    assert fake_hub.files_requested() == []


def test_weights_too_big_for_the_device_are_refused_before_download(fake_hub, tiny_dir):
    fake_hub.add("org/tiny", files_of(tiny_dir))
    with pytest.raises(JaxspecError, match="org/tiny needs about .* in float32 but the given "
                       "memory has .* free: nothing was downloaded"):
        hub.fetch(hub.parse("org/tiny"), dtype="float32", free_bytes=10_000)
    assert fake_hub.files_requested() == ["config.json"]  # what the estimate reads, nothing else


def test_a_cut_connection_resumes_from_where_it_stopped(fake_hub, tiny_dir_v1, monkeypatch):
    import huggingface_hub.constants

    # the hub writes whole chunks (10 MB by default); a small one lets a tiny file be cut mid-way
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 16384)
    weights = (tiny_dir_v1 / "model.safetensors").read_bytes()
    fake_hub.add("org/tiny", files_of(tiny_dir_v1))
    fake_hub.cut["model.safetensors"] = cut = 8 * 16384
    assert cut < len(weights) // 2
    path = resolve("org/tiny").path
    assert (path / "model.safetensors").read_bytes() == weights
    gets = [r for m, p, r in fake_hub.requests if m == "GET" and p.endswith("model.safetensors")]
    assert len(gets) == 2 and gets[0] is None
    start = int(gets[1].removeprefix("bytes=").removesuffix("-"))  # the rest only
    assert 0 < start <= cut


def test_a_run_that_fails_mid_file_leaves_nothing_trusted_and_the_next_completes(
    fake_hub, tiny_dir_v1, tmp_path
):
    weights = (tiny_dir_v1 / "model.safetensors").read_bytes()
    fake_hub.add("org/tiny", files_of(tiny_dir_v1))
    fake_hub.cut["model.safetensors"] = len(weights) // 2
    fake_hub.refuse_after_cut = True
    with pytest.raises(JaxspecError, match="downloading org/tiny failed .*run the same command"):
        resolve("org/tiny")
    cache = tmp_path / "hf_home" / "hub" / "models--org--tiny"
    assert not list(cache.rglob("model.safetensors"))  # no half file under its final name
    assert not list(cache.rglob("*.incomplete"))
    fake_hub.cut_refused = None
    first = len(fake_hub.requests)
    path = resolve("org/tiny").path
    assert (path / "model.safetensors").read_bytes() == weights
    again = [p for m, p, _ in fake_hub.requests[first:] if m == "GET" and "/resolve/" in p]
    assert [p.rsplit("/", 1)[1] for p in again] == ["model.safetensors"]  # finished files kept


def test_a_drafter_by_id_loads_as_from_its_directory(fake_hub, tmp_path):
    from test_formats import HIDDEN, LAYERS, VOCAB, eagle3_dir
    from tiny import tiny_model

    from jaxspec import formats

    target = tiny_model(seed=11, scale=0.3, vocab=VOCAB, layers=LAYERS, hidden=HIDDEN)
    local = eagle3_dir(tmp_path, "eagle3")[0]
    commit = fake_hub.add("org/eagle3-head", files_of(local) | {"train.py": b"x"})
    drafter_local, params_local = formats.load_drafter_checkpoint("eagle", local, target)
    drafter_hub, params_hub = formats.load_drafter_checkpoint("eagle", "org/eagle3-head", target)
    assert drafter_hub.name == drafter_local.name
    import jax

    leaves_local, leaves_hub = jax.tree.leaves(params_local), jax.tree.leaves(params_hub)
    assert len(leaves_local) == len(leaves_hub) > 0
    assert all(np.array_equal(a, b) for a, b in zip(leaves_local, leaves_hub))
    assert "train.py" not in fake_hub.files_requested()
    # the head came from that commit's files: the snapshot the loader read is the commit's
    assert hub.fetch(hub.parse("org/eagle3-head"), purpose="drafter").commit == commit


def test_ids_local_paths_and_short_names(tmp_path, monkeypatch, tiny_dir):
    assert hub.parse("Qwen/Qwen3-1.7B@v2.0") == hub.HubId(repo_id="Qwen/Qwen3-1.7B",
                                                          revision="v2.0")
    assert hub.parse("org/m-GGUF@main/m.Q4_K_M.gguf") == hub.HubId(
        repo_id="org/m-GGUF", revision="main", gguf_file="m.Q4_K_M.gguf")
    for not_an_id in ("smollm2-135m", "./org/name", "a/b/c", "org/m.gguf", "../x/y", "/abs/path"):
        assert hub.parse(not_an_id) is None, not_an_id
    monkeypatch.chdir(tmp_path)  # a directory that exists and reads as an id: the directory wins
    shutil.copytree(tiny_dir, tmp_path / "org" / "tiny")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # any request would fail
    assert resolve("org/tiny").path == (tmp_path / "org" / "tiny").resolve()
    assert resolve("org/tiny").revision == ""


def test_the_cli_says_one_line_and_exits_2(fake_hub, tiny_dir, capsys):
    from jaxspec import generate

    fake_hub.add("meta/gated", files_of(tiny_dir), gated=True)
    assert generate.main(["--model", "meta/gated", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "HF_TOKEN" in err and "Traceback" not in err
    argv = ["--model", "smollm2-135m", "--gguf-file", "m.gguf", "--prompt", "hi"]
    assert generate.main(argv) == 2
    assert "--gguf-file m.gguf names one .gguf file of the Hub repo" in capsys.readouterr().err


def test_which_files_a_listing_gives():
    sizes = {n: 10 for n in ("config.json", "tokenizer.json", "model.safetensors", "model.py",
                             "pytorch_model.bin", "original/consolidated.00.pth", "README.md")}
    files, weights = hub.choose_files(hub.parse("org/m"), sizes)
    assert files == ["config.json", "model.safetensors", "tokenizer.json"]
    assert weights == ["model.safetensors"]
    ggufs = {"config.json": 1, "m.Q4_K_M.gguf": 10, "m.Q8_0.gguf": 20}
    with pytest.raises(JaxspecError, match="holds 2 .gguf files: name one, e.g. org/g/m.Q4_K_M"):
        hub.choose_files(hub.parse("org/g"), ggufs)
    files, weights = hub.choose_files(hub.parse("org/g/m.Q8_0.gguf"), ggufs)
    assert files == ["config.json", "m.Q8_0.gguf"] and weights == ["m.Q8_0.gguf"]
    with pytest.raises(JaxspecError, match="org/g has no file m.F16.gguf: its .gguf files are"):
        hub.choose_files(hub.parse("org/g/m.F16.gguf"), ggufs)
    own = {"meta.json": 1, "params/_METADATA": 2, "params/d/abc": 3, "train.py": 1}
    files, _ = hub.choose_files(hub.parse("org/head"), own, purpose="drafter")
    assert files == ["meta.json", "params/_METADATA", "params/d/abc"]


def test_a_full_disk_is_one_line(fake_hub, tiny_dir_v1, monkeypatch):
    import errno

    import huggingface_hub

    fake_hub.add("org/tiny", files_of(tiny_dir_v1))

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_space)
    with pytest.raises(JaxspecError, match="disk full while downloading org/tiny into .*hf_home.*: "
                       "free space or point HF_HOME at a larger disk"):
        resolve("org/tiny")


def test_one_gguf_of_a_gguf_repo_by_name(fake_hub, tiny_dir_v1, tmp_path):
    from test_loading import write_gguf

    local = write_gguf(tiny_dir_v1, tmp_path / "m.gguf", "llama")
    data = local.read_bytes()
    fake_hub.add("org/tiny-GGUF", {"m.gguf": data, "other.gguf": data + b"\0",
                                   "tokenizer.json": b"{}"})
    src = resolve("org/tiny-GGUF/m.gguf")
    assert src.kind == "gguf" and src.path.name == "m.gguf"
    assert fake_hub.files_requested() == ["m.gguf"]  # not the other .gguf, not the tokenizer
    by_id, ref = load_model("org/tiny-GGUF/m.gguf"), load_model(local)
    import jax

    assert all(np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(by_id.params), jax.tree.leaves(ref.params), strict=True))
