"""`vllm serve` flags on `deltaspec serve`: several served model names (requests may name any,
responses and metrics name the first), HTTPS from vLLM's --ssl-* flags (client certificates
included), the log level, the engine flags (each reaching EngineConfig and surviving `bench
serve`'s round trip to a server process), and the one-line errors for what cannot be honoured.
test_cli.py runs a whole vLLM command line as a process."""

import argparse
import logging
import re
import shutil
import ssl
import subprocess

import aiohttp
import pytest
import pytest_asyncio

from deltaspec.engine import AsyncLLM
from deltaspec.server import cli
from deltaspec.server.config import ServerConfig
from deltaspec.server.engine_args import add_engine_options, engine_flags, engine_options
from deltaspec.server.serve import listen, start

in_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(checkpoint):
    engine = AsyncLLM(checkpoint("qwen3_5"), max_model_len=256, num_draft_tokens=0)
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """(certificate, key): PEM files of a self-signed certificate for 127.0.0.1."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = str(directory / "cert.pem"), str(directory / "key.pem")
    if shutil.which("openssl"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", key, "-out", cert], check=True, capture_output=True)
        return cert, key
    x509 = pytest.importorskip("cryptography.x509", reason="needs the openssl command or the cryptography package")
    import datetime
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    built = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private_key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now)
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
             .sign(private_key, hashes.SHA256()))
    with open(cert, "wb") as file:
        file.write(built.public_bytes(serialization.Encoding.PEM))
    with open(key, "wb") as file:
        file.write(private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
    return cert, key


# Served model names ------------------------------------------------------------------------------

@in_module_loop
async def test_requests_may_name_any_served_name_and_responses_name_the_first(engine):
    running = await start(engine, ServerConfig(model_name="first", model_aliases=("org/second",), port=0,
                                               shutdown_timeout=1))
    body = {"prompt": "Hello", "max_tokens": 2}
    try:
        async with aiohttp.ClientSession(running.url) as http:
            for name in ("first", "org/second"):
                async with http.post("/v1/completions", json={**body, "model": name}) as response:
                    assert response.status == 200 and (await response.json())["model"] == "first"
            async with http.post("/v1/chat/completions", json={"model": "org/second", "max_tokens": 2,
                                                               "messages": [{"role": "user", "content": "hi"}]}) \
                    as response:
                assert response.status == 200 and (await response.json())["model"] == "first"
            async with http.post("/v1/completions", json={**body, "model": "third"}) as response:
                error = (await response.json())["error"]
            assert response.status == 404 and error["code"] == "model_not_found"
            assert "serves 'first', 'org/second'" in error["message"]
            async with http.get("/v1/models") as response:
                assert [card["id"] for card in (await response.json())["data"]] == ["first", "org/second"]
            for name in ("first", "org/second"):
                async with http.get(f"/v1/models/{name}") as response:
                    assert response.status == 200 and (await response.json())["id"] == name
            async with http.get("/v1/models/third") as response:
                assert response.status == 404
            async with http.get("/metrics") as response:
                metrics = await response.text()
            assert 'model_name="first"' in metrics and "org/second" not in metrics
    finally:
        await running.stop()


@pytest.mark.parametrize("aliases, message", [
    (("",), "served model names must not be empty"),
    (("b", "first"), "served model names must differ, got 'first', 'b', 'first'"),
])
def test_served_model_names_are_validated(aliases, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerConfig(model_name="first", model_aliases=aliases)


# HTTPS -------------------------------------------------------------------------------------------

@in_module_loop
async def test_https_with_vllms_ssl_flags(engine, certificate, tmp_path):
    cert, key = certificate
    trusting = ssl.create_default_context(cafile=cert)
    combined = tmp_path / "combined.pem"  # uvicorn takes the key from the certificate's file too
    combined.write_text(open(cert).read() + open(key).read())
    for files in ({"ssl_certfile": cert, "ssl_keyfile": key}, {"ssl_certfile": str(combined)}):
        running = await start(engine, ServerConfig(model_name="tiny", port=0, shutdown_timeout=1, **files))
        try:
            assert running.url == f"https://127.0.0.1:{running.port}"  # the start-up log line's
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{running.url}/v1/models", ssl=trusting) as response:
                    assert response.status == 200 and (await response.json())["data"][0]["id"] == "tiny"
                with pytest.raises(aiohttp.ClientConnectorCertificateError):  # a certificate nobody signed
                    await http.get(f"{running.url}/health")
                with pytest.raises(aiohttp.ClientError):  # plain HTTP to the TLS port
                    await http.get(f"http://127.0.0.1:{running.port}/health")
        finally:
            await running.stop()


@in_module_loop
async def test_client_certificates_when_ssl_cert_reqs_requires_them(engine, certificate):
    cert, key = certificate
    running = await start(engine, ServerConfig(model_name="tiny", port=0, shutdown_timeout=1, ssl_certfile=cert,
                                               ssl_keyfile=key, ssl_ca_certs=cert, ssl_cert_reqs=ssl.CERT_REQUIRED))
    anonymous = ssl.create_default_context(cafile=cert)
    signed = ssl.create_default_context(cafile=cert)
    signed.load_cert_chain(cert, key)  # the self-signed certificate is its own CA
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{running.url}/health", ssl=signed) as response:
                assert response.status == 200
            with pytest.raises(aiohttp.ClientError):
                async with http.get(f"{running.url}/health", ssl=anonymous) as response:
                    await response.read()
    finally:
        await running.stop()


@pytest.mark.parametrize("files, message", [
    ({"ssl_keyfile": "key.pem"}, "ssl_keyfile and ssl_ca_certs need ssl_certfile"),
    ({"ssl_certfile": "cert.pem", "ssl_cert_reqs": 2}, "ssl_cert_reqs asks for client certificates"),
    ({"ssl_certfile": "cert.pem", "ssl_cert_reqs": 3}, "ssl_cert_reqs must be 0 (none), 1 (optional) or 2"),
])
def test_incomplete_tls_settings_are_refused(files, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerConfig(model_name="tiny", **files)


def test_a_certificate_that_does_not_load_is_named(certificate, tmp_path):
    cert, key = certificate
    missing = tmp_path / "none.pem"
    with pytest.raises(ValueError, match=re.escape(f"cannot load the TLS certificate {missing}") + ".*No such file"):
        listen(ServerConfig(model_name="tiny", port=0, ssl_certfile=str(missing)))
    with pytest.raises(ValueError, match=r"with its private key \(expected in the same file\): \[SSL\]"):
        listen(ServerConfig(model_name="tiny", port=0, ssl_certfile=cert))  # no key in it
    with pytest.raises(ValueError, match="cannot load the CA certificates"):
        listen(ServerConfig(model_name="tiny", port=0, ssl_certfile=cert, ssl_keyfile=key, ssl_ca_certs=key))


# The command line --------------------------------------------------------------------------------

def test_serve_flags_reach_the_server_and_engine_configs(checkpoint, certificate, monkeypatch):
    path = checkpoint("qwen3_5")
    served = {}

    async def serve(engine_config, server_config, single_process=False):
        served.update(engine=engine_config, server=server_config)

    monkeypatch.setattr(cli, "serve", serve)
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **options: served.update(options))
    cert, key = certificate
    assert cli.main(["serve", str(path), "--served-model-name", "a", "org/b", "--uvicorn-log-level", "trace",
                     "--ssl-certfile", cert, "--ssl-keyfile", key, "--block-size", "32",
                     "--disable-custom-all-reduce", "--disable-log-requests", "--disable-log-stats",
                     "--mamba-ssm-cache-dtype", "bfloat16", "--seed", "3"]) == 0
    server = served["server"]
    assert server.served_model_names == ("a", "org/b") and served["level"] == logging.DEBUG
    assert (server.ssl_certfile, server.ssl_keyfile, server.ssl_cert_reqs) == (cert, key, ssl.CERT_NONE)
    assert served["engine"].block_size == 32 and served["engine"].all_reduce == "nccl"
    assert served["engine"].mamba_ssm_cache_dtype == "bfloat16" and served["engine"].seed == 3
    # Without the flags: the directory's name, plain HTTP, INFO.
    assert cli.main(["serve", str(path)]) == 0
    assert served["server"].served_model_names == (path.name,) and served["server"].scheme == "http"
    assert served["level"] == logging.INFO


def test_vllm_engine_flags_reach_a_server_process_unchanged():
    """What `bench serve` passes its server: the same EngineConfig fields; the flags whose meaning
    holds anyway set none (--language-model-only sets language_model_only)."""
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(["-tp", "2", "--block-size", "32", "--disable-custom-all-reduce", "--kv-cache-dtype",
                              "fp8", "--distributed-executor-backend", "mp", "--enable-chunked-prefill",
                              "--language-model-only"])
    options = engine_options(args)
    assert options == {"tensor_parallel_size": 2, "block_size": 32, "all_reduce": "nccl", "kv_cache_dtype": "fp8",
                       "language_model_only": True}
    assert engine_options(parser.parse_args(engine_flags(args))) == options


def _exit_code(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exited:  # argparse's refusals
        return exited.code


@pytest.mark.parametrize("command, flags, message", [
    ("generate", ("-tp", "2", "--all-reduce", "auto", "--disable-custom-all-reduce"),
     "--disable-custom-all-reduce means --all-reduce nccl, but --all-reduce auto is given: give one"),
    ("generate", ("--block-size", "48"), "checkpoint_interval must be a positive multiple of block_size"),
    ("serve", ("--served-model-name", "a", "a"), "served model names must differ"),
    ("serve", ("--ssl-keyfile", "key.pem"), "ssl_keyfile and ssl_ca_certs need ssl_certfile"),
    ("serve", ("--ssl-certfile", "cert.pem", "--ssl-cert-reqs", "2"), "ssl_cert_reqs asks for client certificates"),
])
def test_what_cannot_be_honoured_is_one_line_and_exit_2(checkpoint, capsys, command, flags, message):
    model = ["--model", str(checkpoint("qwen3_5"))] if command == "generate" else [str(checkpoint("qwen3_5"))]
    argv = [command, "hi", *model, *flags] if command == "generate" else [command, *model, "--port", "0", *flags]
    assert _exit_code(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize("flags, message", [
    (("--distributed-executor-backend", "ray"), "invalid choice: 'ray'"),
    (("--uvicorn-log-level", "verbose"), "invalid choice: 'verbose'"),
    (("--kv-cache-dtype", "fp8_e5m2"), "invalid choice: 'fp8_e5m2'"),
])
def test_values_vllm_has_and_this_engine_does_not_are_argparse_errors(checkpoint, capsys, flags, message):
    assert _exit_code(["serve", str(checkpoint("qwen3_5")), "--port", "0", *flags]) == 2
    assert message in capsys.readouterr().err
