"""Run a real tritonserver (from the nvidia-pytriton wheel) on CPU for tests, and clean up after it.

- The python backend folder is linked into a temp dir with the stub for this Python version.
- The model's environment (EXECUTION_ENV_PATH) is a small venv that holds only numpy<2 (Triton's
  stub dies on numpy 2 string tensors) and a .pth that adds this interpreter's site-packages (and
  PYTHONPATH's entries), so it sees enginesmith and everything else installed here. It is built once
  per machine under the cache dir (needs `pip` to reach the package index once, or a folder of wheels
  named by ENGINESMITH_TRITON_WHEELS).
- The server is started with its own shm prefix and stopped by PID; `stop()` reports anything it
  left in /dev/shm or /tmp (python_env_*) and removes it by exact name.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from enginesmith.core.paths import cache_dir

MODEL_ENV_REQUIREMENTS = ["numpy<2"]
GRPC_TYPES = {"max_tokens": ("INT64", "int64"), "temperature": ("FP32", "float32"), "top_k": ("INT64", "int64"),
              "top_p": ("FP32", "float32"), "repetition_penalty": ("FP32", "float32"), "seed": ("INT64", "int64"),
              "raw": ("BOOL", "bool")}


def pytriton_root() -> Path | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    return root if (root / "bin" / "tritonserver").is_file() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_env() -> Path:
    """A venv with numpy<2 that also sees this interpreter's packages; built once, then reused."""
    # this interpreter's site-packages and PYTHONPATH entries (the stub ignores PYTHONPATH itself)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sites = [p for p in [*extra, *site.getsitepackages()] if os.path.isdir(p)]
    key = hashlib.sha256(json_key(sys.prefix, sites, MODEL_ENV_REQUIREMENTS).encode()).hexdigest()[:12]
    env = cache_dir() / "triton-model-env" / f"py{sys.version_info.major}{sys.version_info.minor}-{key}"
    done = env / ".complete"
    if done.exists():
        return env
    tmp = env.with_name(env.name + f".tmp-{os.getpid()}")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(tmp)], check=True)
    py = tmp / "bin" / "python"
    wheels = os.environ.get("ENGINESMITH_TRITON_WHEELS")  # a folder of wheels, for a machine without an index
    index = ["--no-index", "--find-links", wheels] if wheels else []
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet",
                    "--disable-pip-version-check", *index, *MODEL_ENV_REQUIREMENTS], check=True)
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in sites)
    Path(purelib, "_enginesmith_parent_site.pth").write_text(lines)
    if env.exists():  # an incomplete earlier attempt
        shutil.rmtree(env)
    os.replace(tmp, env)
    _fix_venv_paths(env, tmp)  # activate scripts name the venv's own path
    done.write_text("ok\n")
    return env


def json_key(*parts: object) -> str:
    import json
    return json.dumps(parts, sort_keys=True, default=str)


def _fix_venv_paths(env: Path, old: Path) -> None:
    """Rewrite the temp path the venv was created at (activate scripts, pyvenv.cfg) to its final one."""
    for f in [env / "pyvenv.cfg", *env.glob("bin/activate*")]:
        if f.is_file():
            f.write_text(f.read_text().replace(str(old), str(env)))


@dataclass
class TritonServer:
    repo: Path
    workdir: Path
    log_path: Path = field(init=False)
    http_port: int = field(init=False, default=0)
    grpc_port: int = field(init=False, default=0)
    shm_prefix: str = field(init=False, default="")
    proc: subprocess.Popen | None = field(init=False, default=None)
    _tmp_envs_before: set = field(init=False, default_factory=set)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, models: list[str], timeout: float = 300.0) -> None:
        root = pytriton_root()
        assert root is not None, "nvidia-pytriton is not installed"
        backends = self.workdir / "backends"
        python_backend = backends / "python"
        python_backend.mkdir(parents=True, exist_ok=True)
        for f in (root / "backends" / "python").iterdir():
            if f.is_file():
                os.symlink(f, python_backend / f.name)
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        os.symlink(root / "python_backend_stubs" / ver / "triton_python_backend_stub",
                   python_backend / "triton_python_backend_stub")
        self.http_port, self.grpc_port = _free_port(), _free_port()
        self.shm_prefix = f"enginesmith_test_{uuid.uuid4().hex[:8]}_"
        libs = [sysconfig.get_config_var("LIBDIR"), str(root.parent.parent / "nvidia_pytriton.libs")]
        env = dict(os.environ, LD_LIBRARY_PATH=":".join(libs + [os.environ.get("LD_LIBRARY_PATH", "")]))
        cmd = [str(root / "bin" / "tritonserver"), f"--model-repository={self.repo}",
               f"--backend-directory={backends}", "--model-control-mode=explicit",
               *[f"--load-model={m}" for m in models],
               "--http-address=127.0.0.1", f"--http-port={self.http_port}",
               "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
               "--allow-metrics=false", "--disable-auto-complete-config", "--exit-timeout-secs=5",
               "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}", "--log-verbose=0"]
        self._tmp_envs_before = set(glob.glob("/tmp/python_env_*"))
        self.log_path = self.workdir / "tritonserver.log"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                                     stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}:\n{self.log_tail()}")
            if all(self.ready(m) for m in models):
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def ready(self, model: str) -> bool:
        """Whether the server says `model` is ready (False when it cannot be reached)."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/models/{model}/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def leftovers(self) -> list[str]:
        """What the server left behind: its shm regions and python_env dirs made while it ran."""
        shm = glob.glob(f"/dev/shm/*{self.shm_prefix}*") if self.shm_prefix else []
        envs = sorted(set(glob.glob("/tmp/python_env_*")) - self._tmp_envs_before)
        return shm + envs + [f"pid {pid}" for pid in self.stub_pids()]

    def stub_pids(self) -> list[int]:
        """Live stub processes of this server (their command line names its shm prefix)."""
        pids = []
        for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
            try:
                text = Path(cmdline).read_bytes()
            except OSError:
                continue
            if self.shm_prefix and self.shm_prefix.encode() in text and b"triton_python_backend_stub" in text:
                pids.append(int(cmdline.split("/")[2]))
        return pids

    def stop(self, timeout: float = 30.0) -> list[str]:
        """SIGTERM the server by PID (SIGKILL after `timeout`); remove and return what it left behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        left = self.leftovers()
        for pid in self.stub_pids():  # orphaned stubs of this server only, by PID
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for path in left:
            if path.startswith("pid "):
                continue
            p = Path(path)
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        return left


class GrpcStream:
    """One gRPC stream to the server (tritonclient's start_stream), open until `close()`; `infer` sends
    one request on it and collects its responses. Opening costs a channel: open streams before timing."""

    def __init__(self, url: str) -> None:
        import queue

        import tritonclient.grpc as grpcclient

        self.results: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def infer(self, model: str, prompt: str | None, on_chunk=None, cancel_after: int | None = None,
              timeout: float = 300.0, **params) -> dict:
        """{"text", "token_ids", "finish_reason", "chunks", "first_s", "total_s"} or {"error", "chunks"};
        `on_chunk` is called at each response. With `cancel_after`, the client cancels the request after
        that many responses (closing the stream) and gets {"cancelled": True, "chunks"}."""
        import numpy as np
        import tritonclient.grpc as grpcclient

        inputs = []
        if prompt is not None:
            inputs.append(grpcclient.InferInput("text_input", [1], "BYTES"))
            inputs[-1].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        for name, value in params.items():
            triton_type, np_type = GRPC_TYPES[name]
            inputs.append(grpcclient.InferInput(name, [1], triton_type))
            inputs[-1].set_data_from_numpy(np.array([value], dtype=np_type))
        begun = time.perf_counter()
        self.client.async_stream_infer(model, inputs)
        out: dict = {"text": "", "chunks": 0}
        while True:
            result, error = self.results.get(timeout=timeout)
            if error is not None:
                return {"error": str(error), "chunks": out["chunks"]}
            out["text"] += result.as_numpy("text_output")[0].decode()
            out["chunks"] += 1
            out.setdefault("first_s", time.perf_counter() - begun)
            if on_chunk is not None:
                on_chunk()
            finish = result.as_numpy("finish_reason")
            if finish is not None:
                out["finish_reason"] = finish[0].decode()
                out["token_ids"] = result.as_numpy("token_ids").tolist()
                out["total_s"] = time.perf_counter() - begun
                return out
            if cancel_after is not None and out["chunks"] >= cancel_after:
                self.close(cancel_requests=True)
                return {"cancelled": True, "chunks": out["chunks"]}

    def close(self, cancel_requests: bool = False) -> None:
        if self.client is not None:
            self.client.stop_stream(cancel_requests=cancel_requests)
            self.client.close()
            self.client = None


def grpc_stream(url: str, model: str, prompt: str | None, on_chunk=None, cancel_after: int | None = None,
                timeout: float = 300.0, **params) -> dict:
    """One request on a stream of its own (GrpcStream.infer), closed after it."""
    stream = GrpcStream(url)
    try:
        return stream.infer(model, prompt, on_chunk, cancel_after, timeout, **params)
    finally:
        stream.close()
