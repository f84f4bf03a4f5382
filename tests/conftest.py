"""Shared test setup: offline Hugging Face, quiet Megatron imports, and small dataset factories."""

import logging
import os
import tempfile
import warnings

import pytest
from hypothesis import Phase, settings

# Mutation testing (docs/development.md) runs the tests with --hypothesis-profile=mutation: a failing example is
# reported as found, not shrunk (shrinking reruns a test many times; the mutant is killed either way).
settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate])

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MMIDX_CACHE_DIR", tempfile.mkdtemp(prefix="mmidx-test-cache-"))  # never the user's cache
warnings.filterwarnings("ignore", module="megatron")
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")


@pytest.fixture(params=["scalar", "sse4", "avx2", "avx2-madd"])
def resize_kernel(request):
    """Each kernel of the Pillow-exact resize (csrc/_pixels_rows.h, csrc/_pixels_simd.h) forced in turn; one this
    CPU (or build) lacks is skipped, saying so, never counted as passing."""
    from mmidx import _pixels

    if request.param not in _pixels.available_kernels():
        pytest.skip(f"this CPU does not run the {request.param} resize kernel "
                    f"(available: {', '.join(_pixels.available_kernels())})")
    previous = _pixels.kernel()
    _pixels.set_kernel(request.param)
    yield request.param
    _pixels.set_kernel(previous)


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The quick demo (build, index, packs) in a relative folder, as the README's command runs it."""
    from mmidx.toolkit.demo import run

    folder = tmp_path_factory.mktemp("cwd")
    steps = []  # each step's line, and whether the datasets existed when it was told
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        result = run("mmidx-demo", quick=True,
                     progress=lambda line: steps.append((line, os.path.exists("mmidx-demo/datasets/data.yaml"))))
    return {**result, "steps": steps}


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 server (moto's) on 127.0.0.1 for this test process, with a bucket ``mmidx``; the AWS
    variables and mmidx's cache folder point at it and a temporary folder while the session lasts.

    Yields a helper: ``s3.upload(prefix, uri)`` copies a local dataset's files, ``s3.client`` is boto3's."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    settings = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": f"http://{host}:{port}", "MMIDX_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    client = boto3.client("s3")
    client.create_bucket(Bucket="mmidx")

    class S3:
        endpoint = f"{host}:{port}"

        def __init__(self):
            self.client = client

        @staticmethod
        def upload(prefix, uri):
            """Put every file of the local dataset ``prefix`` at ``uri`` (s3://mmidx/...)."""
            from mmidx.read.dataset import dataset_files

            key = uri.removeprefix("s3://mmidx/")
            for path in dataset_files(prefix):
                client.upload_file(str(path), "mmidx", key + path.name[len(os.path.basename(prefix)):])
            return uri

    yield S3()
    server.stop()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def cluster():
    """The one local Ray cluster of the test session (``ray.init(num_cpus=2)``); yields its address."""
    ray = pytest.importorskip("ray")
    tests = os.path.dirname(__file__)  # workers import the tests' encoders (mmidx precache --engine ray)
    path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                       runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield context.address_info["gcs_address"]
    ray.shutdown()
