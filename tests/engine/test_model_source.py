"""Hugging Face Hub repo ids as the model (engine/model_source.py): downloaded through the real
huggingface_hub client from a fake Hub on loopback that serves the tiny checkpoint's files
(plus a README the engine never reads, a gated repo, a repo without config.json), then found
in the cache with HF_HUB_OFFLINE set; the engine, the engine process and the CLI load the
download and generate what the local directory generates; every wrong id, revision or path
fails with one line. Device and dtype "auto" follow the machine and the checkpoint."""

import asyncio
import hashlib
import json
import shutil
import threading

import huggingface_hub.constants
import pytest
import torch
from aiohttp import web

from deltaspec.engine import LLM, EngineConfig, SamplingParams
from deltaspec.engine.engine_process import EngineProcess
from deltaspec.engine.model_source import local_config, resolve_model
from deltaspec.server import cli

COMMIT = "5eed0123456789abcdef0123456789abcdef0123"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


class FakeHub:
    """The Hub's routes snapshot_download uses (repo info, tree, resolve: HEAD and GET), for
    repos {id: directory} at revisions main and v1 (both COMMIT); 'acme/gated' answers as a
    gated repo, unknown repos and revisions as the Hub does (X-Error-Code)."""

    def __init__(self, repos: dict):
        self.repos = {name: {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
                      for name, directory in repos.items()}
        self.requests: list[str] = []
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}/revision/{revision}", self.info)
        app.router.add_get("/api/models/{org}/{name}/tree/{revision:.*}", self.tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{revision}/{file}", self.resolve)
        self.runner = web.AppRunner(app)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        started.wait()

    def _serve(self, started: threading.Event) -> None:
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.endpoint = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        started.set()
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)

    def _files(self, request: web.Request) -> dict:
        self.requests.append(f"{request.method} {request.path}")
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        if repo == "acme/gated":
            raise web.HTTPForbidden(headers={"X-Error-Code": "GatedRepo"}, text="gated")
        if repo not in self.repos:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"}, text="no repo")
        if request.match_info["revision"] not in ("main", "v1", COMMIT):
            raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"}, text="no revision")
        return self.repos[repo]

    async def info(self, request: web.Request) -> web.Response:
        files = self._files(request)
        return web.json_response({"id": request.path, "sha": COMMIT, "siblings": [{"rfilename": n} for n in files]})

    async def tree(self, request: web.Request) -> web.Response:
        return web.json_response([{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                                  for name, data in self._files(request).items()])

    async def resolve(self, request: web.Request) -> web.Response:
        data = self._files(request)[request.match_info["file"]]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                   "Content-Length": str(len(data))}
        return web.Response(headers=headers, body=None if request.method == "HEAD" else data)


@pytest.fixture(scope="module")
def repo(checkpoint, tmp_path_factory):
    """The tiny checkpoint as a Hub repo's files, with a README the engine never reads; and a
    repo of that README alone."""
    directory = tmp_path_factory.mktemp("hub_repo") / "tiny"
    shutil.copytree(checkpoint("qwen3_5"), directory)
    (directory / "README.md").write_text("# tiny\n")
    readme_only = directory.parent / "readme_only"
    readme_only.mkdir()
    (readme_only / "README.md").write_text("# no weights\n")
    return {"acme/tiny": directory, "acme/readme-only": readme_only}


@pytest.fixture
def hub(repo, monkeypatch):
    hub = FakeHub(repo)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    yield hub
    hub.close()


def offline(monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_a_repo_id_downloads_the_checkpoint_files_then_the_cache_serves_it_offline(hub, repo, tmp_path, monkeypatch):
    path = resolve_model("acme/tiny", download_dir=tmp_path)
    assert path.is_relative_to(tmp_path) and path.name == COMMIT
    wanted = {p.name for p in repo["acme/tiny"].iterdir()} - {"README.md"}
    assert {p.name for p in path.iterdir()} == wanted
    for name in wanted:
        assert (path / name).read_bytes() == (repo["acme/tiny"] / name).read_bytes()
    assert not any("README" in r for r in hub.requests)

    hub.requests.clear()
    offline(monkeypatch)
    for revision in (None, COMMIT):
        assert resolve_model("acme/tiny", revision, download_dir=tmp_path) == path
    assert hub.requests == []
    with pytest.raises(FileNotFoundError, match="not in the Hub cache .* HF_HUB_OFFLINE is set"):
        resolve_model("acme/other", download_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="at revision v1 is not in the Hub cache"):
        resolve_model("acme/tiny", "v1", download_dir=tmp_path)


def test_an_engine_on_a_repo_id_generates_what_the_directory_does(hub, repo, tmp_path):
    with LLM(repo["acme/tiny"], max_model_len=128) as local:
        expected = [out.token_ids for out in local.generate([[1, 2, 3], "def f(x):"], GREEDY)]
    with LLM("acme/tiny", revision="v1", download_dir=str(tmp_path), max_model_len=128) as downloaded:
        assert downloaded.core.config.model == resolve_model("acme/tiny", "v1", download_dir=tmp_path)
        assert [out.token_ids for out in downloaded.generate([[1, 2, 3], "def f(x):"], GREEDY)] == expected


@pytest.mark.asyncio
async def test_the_engine_process_resolves_the_repo_once_before_it_starts(hub, tmp_path):
    config = EngineConfig(model="acme/tiny", download_dir=str(tmp_path), max_model_len=128, num_draft_tokens=0)
    engine = await EngineProcess.start(config)
    try:
        tokens = [t async for delta in engine.generate([1, 2, 3], GREEDY) for t in delta.token_ids]
    finally:
        await engine.shutdown()
    assert len(tokens) == GREEDY.max_tokens
    assert sum(r.startswith("GET /api/models/acme/tiny/revision") for r in hub.requests) == 1


def test_the_cli_takes_a_repo_id_and_serves_it_under_that_name(hub, repo, tmp_path, capsys):
    assert cli.main(["generate", "def f(x):", "--model", str(repo["acme/tiny"]), "--max-tokens", "6",
                     "--temperature", "0"]) == 0
    expected = capsys.readouterr().out
    assert cli.main(["generate", "def f(x):", "--model", "acme/tiny", "--download-dir", str(tmp_path),
                     "--revision", "main", "--max-tokens", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == expected
    assert cli._served_name("acme/tiny") == "acme/tiny"
    assert cli._served_name(str(repo["acme/tiny"])) == "tiny"


def test_wrong_ids_revisions_and_paths_fail_with_one_line(hub, repo, tmp_path):
    cache = str(tmp_path / "cache")
    cases = [
        (dict(model="acme/missing", download_dir=cache), FileNotFoundError, "no such repo on the Hugging Face Hub"),
        (dict(model="acme/gated", download_dir=cache), ValueError, "gated repo: accept its terms"),
        (dict(model="acme/tiny", revision="v9", download_dir=cache), ValueError, "has no revision 'v9'"),
        (dict(model="acme/readme-only", download_dir=cache), FileNotFoundError, "no config.json"),
        (dict(model=repo["acme/tiny"], revision="main"), ValueError, "is a local directory"),
        (dict(model=repo["acme/readme-only"]), FileNotFoundError, "no config.json"),
        (dict(model=tmp_path / "nothing" / "here"), FileNotFoundError, "no checkpoint directory at"),
        (dict(model="./relative"), FileNotFoundError, "no checkpoint directory at"),
        (dict(model="not a repo id!"), FileNotFoundError, "neither a directory nor a Hugging Face Hub repo id"),
    ]
    for fields, error, message in cases:
        with pytest.raises(error, match=message) as raised:
            local_config(EngineConfig(**fields))
        assert "\n" not in str(raised.value)


def test_device_and_dtype_auto_follow_the_machine_and_the_checkpoint(repo, tmp_path, monkeypatch):
    """vLLM's defaults: a GPU when there is one, in the checkpoint's half precision (bfloat16 for
    a float32 checkpoint); float32 on the CPU; explicit values and DELTASPEC_DEVICE win."""
    monkeypatch.delenv("DELTASPEC_DEVICE")
    for gpu in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        auto = EngineConfig(model="unused")
        assert (auto.device, auto.dtype) == ("auto", "auto")
        for stored, on_gpu in (("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "bfloat16"),
                               (None, "bfloat16")):
            concrete = auto.concrete(stored)
            assert (concrete.device, concrete.dtype) == (("cuda", on_gpu) if gpu else ("cpu", "float32"))
        assert EngineConfig(model="unused", device="cpu", dtype="bfloat16").concrete("float16").dtype == "bfloat16"
        assert EngineConfig(model="unused", dtype="float32").concrete("bfloat16").dtype == "float32"
    monkeypatch.setenv("DELTASPEC_DEVICE", "cpu")
    assert EngineConfig(model="unused").concrete("bfloat16").device == "cpu"
    # The stored dtype as config.json says it: transformers' `dtype`, the older `torch_dtype`, or
    # a multimodal checkpoint's text_config (the device named, no GPU touched).
    monkeypatch.setenv("DELTASPEC_DEVICE", "cuda:1")
    raw = json.loads((repo["acme/tiny"] / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("dtype", "torch_dtype")}
    for name, config in (("dtype", {**raw, "dtype": "float16"}), ("torch_dtype", {**raw, "torch_dtype": "float16"}),
                         ("text_config", {"text_config": {**raw, "dtype": "float16"}}), ("none", raw)):
        directory = tmp_path / name
        shutil.copytree(repo["acme/tiny"], directory)
        (directory / "config.json").write_text(json.dumps(config))
        resolved = local_config(EngineConfig(model=directory))
        assert (resolved.device, resolved.dtype) == ("cuda:1", "bfloat16" if name == "none" else "float16")
    with pytest.raises(ValueError, match="dtype must be one of auto, float32"):
        EngineConfig(model="unused", dtype="int8")
