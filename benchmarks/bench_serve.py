"""Serving rate: `one-embedding serve` over REST and gRPC, driven by load generators outside the
server's process, against the same `Predictor` called in-process, all in one run.

    python -m benchmarks.bench_serve [--steps 200] [--seconds 5] [--clients 16]

A DLRM (Adagrad, cached_ssd slots, synthetic Kaggle x 0.05) is trained first; its final
checkpoint is served. Requests carry raw features (dense (b, 13) with NaNs, categorical (b, 26)
value strings, binary tensors as tritonclient sends them) in batches of 1 and 64 rows.

- in-process: `Predictor.predict` in one thread (BLAS limited to 1 thread, as the server runs it,
  and BLAS's default threads: the better is the baseline), measured first and again in every
  round of the server cells: on a shared machine the rate moves, so each cell is compared with
  the baseline measured next to it;
- REST: wrk (`wrk -t1 -cCLIENTS --latency`, a C load generator keeping its HTTP/1.1
  connections alive as tritonclient.http does; ``--install-tools`` installs it with apt-get when
  missing, else a missing one ends the run saying what to install) posting the
  same request body. (ApacheBench, used before, speaks HTTP/1.0, whose keep-alive uvicorn does
  not honour: every ab request opened a new connection, half the rate of batch-1 requests
  measured back to back, 570 against 1,127 requests/s on 2026-11-27);
- gRPC: h2load (nghttp2's C HTTP/2 load generator, package nghttp2-client, the same) posting
  the gRPC-framed `ModelInferRequest` with CLIENTS streams in flight (rate and mean latency; the
  server's /metrics count gRPC-level failures, which h2load cannot see), and
  `benchmarks/grpc_load.py` in its own process (grpcio's asyncio client, each call a
  pre-serialized request sent as bytes) for p50 / p99. ghz, a gRPC-aware C load generator, is not
  installable here;
- each with dynamic batching off (`--max-batch-size 1`) and on (`--max-batch-size 1024`): both
  servers run at once and take turns cell by cell, `--rounds` times (default 3); each cell's
  median over the rounds is reported, so the batching on / off ratio compares cells measured
  back to back.

The load generator shares the machine's cores with the server. Then batch 64 again under wrk while
a training run resumes on the same path and publishes a checkpoint every 5 steps (keeping 1), so
the server switches snapshots under load: failed requests must stay 0. Last, what the stacks
themselves cost: an empty handler on uvicorn and on grpcio's asyncio server under the same load
generators (``serve_floors``). Writes results/serve.json and prints the markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .common import markdown_table, print_header, save_result
from .serve_floors import measure_floors

BATCHES = (1, 64)
TRAIN = ["--model", "dlrm", "--optimizer", "adagrad", "--store", "cached_ssd", "--cache-mb", "16",
         "--synthetic-scale", "0.05", "--batch-size", "1024", "--eval-batches", "2",
         "--no-progress", "--metrics", os.devnull]


def train(path: str, *args, wait: bool = True):
    cmd = [sys.executable, "-m", "one_embedding", "train", *TRAIN, "--persistent-path", path,
           *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def make_requests(batch: int, count: int, seed: int):
    """``count`` (dense, categorical) raw requests of ``batch`` synthetic rows."""
    from one_embedding.data import SyntheticCriteo

    src = SyntheticCriteo("kaggle", scale=0.05, seed=7, num_rows=None)
    out = []
    for i in range(count):
        chunk = src.rows(seed * 1_000_003 + i * batch, batch)
        dense = np.round(np.expm1(chunk.dense.astype(np.float64))).astype(np.float32)
        dense[chunk.dense == 0] = np.nan  # the source's missing values
        cat = (chunk.ids - src.offsets[None, :]).astype(str).astype(object)
        out.append((dense, cat))
    return out


def summarize(latencies: list, seconds: float, batch: int) -> dict:
    lat = np.array(latencies) * 1e3
    return {"qps": len(latencies) / seconds, "samples_per_s": len(latencies) * batch / seconds,
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "requests": len(latencies)}


def in_process(predictor, requests, concurrency: int, seconds: float) -> dict:
    lat, stop = [], time.perf_counter() + seconds
    lock = threading.Lock()

    def worker(k):
        i = k
        while time.perf_counter() < stop:
            dense, cat = requests[i % len(requests)]
            t = time.perf_counter()
            predictor.predict(dense, cat)
            with lock:
                lat.append(time.perf_counter() - t)
            i += concurrency

    t0, cpu0 = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, range(concurrency)))
    out = summarize(lat, time.perf_counter() - t0, requests[0][0].shape[0])
    # CPU seconds of every thread of this process (BLAS's included) per call
    out["cpu_ms_per_request"] = (time.process_time() - cpu0) * 1e3 / max(1, len(lat))
    return out


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished children (the load generators)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def batching_costs(server_off_ms: float, server_on_ms: float, model_row_ms: float,
                   goal: float = 5.0) -> dict:
    """Where batch-1 requests' server CPU goes, batching off and on (ms per request): with it
    on, ``model_row_ms`` (a row's share of a merged forward) is the model's and the rest is the
    request's own handling (HTTP or gRPC, decoding, the response, the hand-offs), which merging
    cannot share. ``goal`` times batching-off's rows/s needs at most ``server_off_ms / goal``
    per request, if rows/s follow the server's CPU."""
    return {"server_cpu_ms_batching_off": server_off_ms, "server_cpu_ms_batching_on": server_on_ms,
            "model_ms_per_row_merged": model_row_ms,
            "request_handling_ms_batching_on": max(server_on_ms - model_row_ms, 0.0),
            f"server_cpu_ms_for_{goal:g}x": server_off_ms / goal,
            "cpu_gain": server_off_ms / server_on_ms}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: the load generators this benchmark and its companions drive: command -> Debian/Ubuntu package
LOAD_TOOLS = {"wrk": "wrk", "h2load": "nghttp2-client"}

INSTALL_HELP = ("install the missing load generators with apt-get (as root) before the run; "
                "without it a missing one ends the run, saying what to install")


def find_tools(install: bool = False, tools: dict | None = None) -> dict[str, str]:
    """{command: path} of the load generators ``tools`` (default ``LOAD_TOOLS``). Missing ones
    end the run with a message naming the packages and ``--install-tools``; with ``install``
    (that flag) they are installed with ``apt-get install -y`` first. The benchmark changes the
    system only when asked (it ran apt-get as root on its own before)."""
    import shutil

    tools = LOAD_TOOLS if tools is None else tools
    missing = {t: pkg for t, pkg in tools.items() if not shutil.which(t)}
    packages = " ".join(dict.fromkeys(missing.values()))
    if missing and install:
        cmd = ["apt-get", "install", "-y", *dict.fromkeys(missing.values())]
        if not shutil.which("apt-get"):
            raise SystemExit(f"--install-tools: no apt-get here; install {', '.join(missing)} "
                             f"(Debian/Ubuntu packages: {packages}) and run it again")
        if hasattr(os, "geteuid") and os.geteuid() != 0:
            raise SystemExit(f"--install-tools: `{' '.join(cmd)}` needs root; run it as root "
                             "(or install the packages yourself) and run the benchmark again")
        print(f"installing {', '.join(missing)}: {' '.join(cmd)}", flush=True)
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        missing = {t: pkg for t, pkg in missing.items() if not shutil.which(t)}
        if missing:
            raise SystemExit(f"`{' '.join(cmd)}` (status {done.returncode}) left "
                             f"{', '.join(missing)} missing: {done.stderr.strip()[-500:]}")
    if missing:
        raise SystemExit(f"this benchmark drives the server with {', '.join(missing)}, missing "
                         f"here: install them (Debian/Ubuntu: apt-get install {packages}), or "
                         "run it again with --install-tools to have it run apt-get (as root)")
    return {t: shutil.which(t) for t in tools}


def run_h2load(h2load: str, port: int, body_file: str, clients: int, seconds: float,
               warm_up: int = 1) -> dict:
    """h2load (nghttp2's C HTTP/2 client) posting ``body_file`` as a gRPC ModelInfer call for
    ``seconds`` after ``warm_up`` seconds whose requests it leaves out of its figures,
    ``clients`` streams in flight over 4 connections ->
    {"qps", "requests" (succeeded), "mean_ms", "failed" (HTTP-level: failed, errored, timed
    out)}. h2load sees HTTP statuses only: a gRPC error is an HTTP 200 with a grpc-status
    trailer."""
    import re

    connections = min(4, clients)
    cmd = [h2load, "-c", str(connections), "-m", str(-(-clients // connections)),
           "-D", str(max(1, round(seconds))),
           *(["--warm-up-time", str(warm_up)] if warm_up else []), "-d", body_file,
           "-H", "content-type: application/grpc", "-H", "te: trailers",
           f"http://127.0.0.1:{port}/inference.GRPCInferenceService/ModelInfer"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 180)
    if out.returncode != 0:
        raise SystemExit(f"h2load failed: {out.stderr[-2000:]}{out.stdout[-2000:]}")
    qps = float(re.search(r"finished in [\d.]+s, ([\d.]+) req/s", out.stdout).group(1))
    done = re.search(r"requests: (\d+) total.*?(\d+) succeeded, (\d+) failed, (\d+) errored, "
                     r"(\d+) timeout", out.stdout)
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)\b", out.stdout)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[mean.group(2)]
    return {"qps": qps, "requests": int(done.group(2)), "mean_ms": float(mean.group(1)) * scale,
            "failed": int(done.group(3)) + int(done.group(4)) + int(done.group(5))}


def drive_h2load(h2load: str, server: "Server", body_file: str, clients: int,
                 seconds: float) -> dict:
    """gRPC load from h2load (``run_h2load``) on ``server``; failures also counted from the
    server's own /metrics (gRPC-level refusals h2load cannot see); h2load reports the mean
    latency, not percentiles."""
    before = grpc_failures(server)
    r = run_h2load(h2load, server.grpc_port, body_file, clients, seconds)
    r["failed"] += grpc_failures(server) - before
    return r


def server_count(server: "Server", sample: str, **labels) -> float:
    """The sum of the server's /metrics samples named ``sample`` whose labels include
    ``labels``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == sample
               and all(s.labels.get(k) == v for k, v in labels.items()))


def grpc_failures(server: "Server") -> float:
    """The server's count of refused or failed gRPC requests (its /metrics, one scrape), less
    those the client cancelled (code 499: h2load resets the streams still in flight when its
    time is up)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == "one_embedding_request_failures_total"
               and s.labels.get("protocol") == "grpc" and s.labels.get("code") != "499")


def rest_body(dense, cat) -> tuple[bytes, int]:
    """The REST request tritonclient.http sends (binary tensors, binary output) and its JSON
    header's length."""
    import tritonclient.http as httpclient

    a = httpclient.InferInput("dense", list(dense.shape), "FP32")
    a.set_data_from_numpy(dense)
    b = httpclient.InferInput("categorical", list(cat.shape), "BYTES")
    b.set_data_from_numpy(cat)
    out = [httpclient.InferRequestedOutput("probability", binary_data=True)]
    body, n = httpclient.InferenceServerClient.generate_request_body([a, b], outputs=out)
    return body, int(n)


def grpc_body(dense, cat) -> bytes:
    """The serialized ModelInferRequest tritonclient.grpc sends (raw input contents)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name="dlrm")
    for name, array, dtype in (("dense", dense, "FP32"), ("categorical", cat, "BYTES")):
        i = grpcclient.InferInput(name, list(array.shape), dtype)
        i.set_data_from_numpy(array)
        req.inputs.extend([i._get_tensor()])
        req.raw_input_contents.extend([i._get_content()])
    return req.SerializeToString()


_WRK_SCRIPT = """\
local f = assert(io.open({body!r}, "rb"))
wrk.method = "POST"
wrk.body = f:read("*all")
f:close()
wrk.headers["Content-Type"] = "application/octet-stream"
wrk.headers["Inference-Header-Content-Length"] = "{header}"
"""


def _wrk_ms(text: str) -> float:
    """A wrk duration ("812.00us", "14.43ms", "1.20s") in milliseconds."""
    import re

    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]


def drive_rest(wrk: str, port: int, body_file: str, header: int, clients: int,
               seconds: float, folder: str, path: str = "/v2/models/dlrm/infer") -> dict:
    """wrk (one thread, ``clients`` HTTP/1.1 keep-alive connections, as tritonclient.http keeps
    them) posting ``body_file`` for ``seconds``: requests/s, p50/p99 (``--latency``), failures
    (non-2xx answers and socket errors)."""
    import re

    script = os.path.join(folder, "post.lua")
    with open(script, "w") as f:
        f.write(_WRK_SCRIPT.format(body=body_file, header=int(header)))
    cmd = [wrk, "-t1", f"-c{clients}", f"-d{max(1, round(seconds))}s", "--timeout", "120s",
           "--latency", "-s", script, f"http://127.0.0.1:{port}{path}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 180)
    if out.returncode != 0:
        raise SystemExit(f"wrk failed: {out.stderr[-2000:]}{out.stdout[-2000:]}")
    text = out.stdout
    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m),", text)
    pct = dict(re.findall(r"^\s+(\d+)%\s+(\S+)$", text, re.MULTILINE))
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    sockets = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                        text)
    failed = (int(non_2xx.group(1)) if non_2xx else 0) + \
        (sum(map(int, sockets.groups())) if sockets else 0)
    return {"requests": int(done.group(1)),
            "qps": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)),
            "failed": failed, "p50_ms": _wrk_ms(pct["50"]), "p99_ms": _wrk_ms(pct["99"])}


def drive_grpc(port: int, body_file: str, clients: int, seconds: float) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.grpc_load", f"127.0.0.1:{port}", body_file,
           "--clients", str(clients), "--seconds", str(seconds)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 180, cwd=root,
                         env={**os.environ, "PYTHONPATH": root + os.pathsep +
                              os.environ.get("PYTHONPATH", "")})
    if out.returncode != 0:
        raise SystemExit(f"the gRPC load generator failed: {out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["qps"] = r["requests"] / r["seconds"]
    if r["first_failure"]:
        print("  gRPC failure:", r["first_failure"], flush=True)
    return r


class Server:
    """``one-embedding serve`` on free REST and gRPC ports, until ``close()``."""

    def __init__(self, path: str, *args):
        import tritonclient.http as httpclient

        self.port, self.grpc_port = free_port(), free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "one_embedding", "serve",
                                      "--persistent-path", path, "--port", str(self.port),
                                      "--grpc-port", str(self.grpc_port),
                                      # the server's private stores under the run's folder
                                      "--scratch", os.path.dirname(path), *map(str, args)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = httpclient.InferenceServerClient(f"127.0.0.1:{self.port}")
        deadline = time.monotonic() + 120
        while True:
            try:
                if probe.is_server_ready():
                    return
            except Exception:  # not up yet
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("the server did not come up")
            time.sleep(0.2)

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.proc.pid)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


PROTOCOLS = ("REST", "gRPC", "gRPC aio client")


def measure_cell(server: "Server", proto: str, files: tuple, clients: int, seconds: float,
                 tools: dict, folder: str) -> dict:
    """One cell: ``proto`` load (REST: wrk; gRPC: h2load; "gRPC aio client": grpc_load) on
    ``server`` for ``seconds`` -> rate, latency, failures and the CPU per answered request (the
    server's own count, h2load's warm-up included) of the server, all its threads, and of the
    load generator. files: (REST body, its JSON header length, gRPC message, gRPC-framed)."""
    rest_file, header, grpc_file, h2_file = files
    answered = server_count(server, "one_embedding_requests_total", model="dlrm")
    server_cpu, client_cpu = server.cpu_seconds(), children_cpu_seconds()
    if proto == "REST":
        r = drive_rest(tools["wrk"], server.port, rest_file, header, clients, seconds, folder)
    elif proto == "gRPC":
        r = drive_h2load(tools["h2load"], server, h2_file, clients, seconds)
    else:
        r = drive_grpc(server.grpc_port, grpc_file, clients, seconds)
    served = max(1.0, server_count(server, "one_embedding_requests_total", model="dlrm")
                 - answered)
    return {"qps": r["qps"], "failed": r["failed"], "p50_ms": r.get("p50_ms"),
            "p99_ms": r.get("p99_ms"), "mean_ms": r.get("mean_ms"),
            "server_cpu_ms": (server.cpu_seconds() - server_cpu) * 1e3 / served,
            "client_cpu_ms": (children_cpu_seconds() - client_cpu) * 1e3 / served}


def median_cell(runs: list) -> dict:
    """Rounds of one cell -> the median of each number ("failed": the sum; other values: the
    first round's), and "rounds"."""
    out = {"rounds": len(runs)}
    for key, value in runs[0].items():
        if key == "failed":
            out[key] = sum(r[key] for r in runs)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(np.median([r[key] for r in runs if r.get(key) is not None]))
        elif value is not None:
            out[key] = value
    return out


def in_process_one_thread(path: str, requests, seconds: float) -> dict:
    """Predictor.predict in this thread: BLAS limited to 1 thread (as the server runs it) and at
    BLAS's default; the better one is the baseline."""
    from threadpoolctl import threadpool_limits

    from one_embedding.serving import Predictor

    out = {}
    with Predictor(path) as predictor:
        for label, limit in (("1", 1), ("default", None)):
            with threadpool_limits(limit, user_api="blas"):
                out[label] = in_process(predictor, requests, 1, seconds)
    best = max(out, key=lambda k: out[k]["qps"])
    return {**out[best], "blas_threads": best,
            "qps_other_blas": out["default" if best == "1" else "1"]["qps"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="training steps before serving")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per cell")
    p.add_argument("--clients", type=int, default=16, help="requests kept in flight")
    p.add_argument("--max-batch-size", type=int, default=1024,
                   help="the server's --max-batch-size with dynamic batching on")
    p.add_argument("--max-queue-delay-us", type=float, default=0.0,
                   help="the server's --max-queue-delay-us with dynamic batching on")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of the server cells (batching off and on take turns in each); "
                        "medians reported")
    p.add_argument("--dir", default=None, help="folder for the run (default: $TMPDIR)")
    p.add_argument("--install-tools", action="store_true", help=INSTALL_HELP)
    args = p.parse_args(argv)
    tools = find_tools(args.install_tools)
    wrk, h2load = tools["wrk"], tools["h2load"]
    config = {"model": "dlrm", "store": "cached_ssd slots", "steps": args.steps,
              "batches": BATCHES, "clients": args.clients, "seconds per cell": args.seconds,
              "rounds": args.rounds,
              "batching on": f"--max-batch-size {args.max_batch_size} --max-queue-delay-us "
                             f"{args.max_queue_delay_us:g}",
              "REST load": "wrk -t1 (HTTP/1.1 keep-alive)",
              "gRPC load": "h2load (rate, mean latency); "
              "benchmarks.grpc_load (grpcio aio client, own process: p50 / p99)"}
    machine = print_header("serving: one-embedding serve over REST and gRPC vs Predictor "
                           "in-process", config)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_serve_", dir=args.dir) as root:
        path = os.path.join(root, "run")
        train(path, "--steps", args.steps, "--snapshot-interval", args.steps)
        bodies = {}
        for batch in BATCHES:
            requests = make_requests(batch, max(8, 4096 // batch), seed=batch)
            base = in_process_one_thread(path, requests, args.seconds)
            rows.append({"mode": "in-process, 1 thread", "batch": batch, "clients": 1, **base,
                         "rows_per_s": base["qps"] * batch})
            print(f"in-process batch {batch:3d}: {base['qps'] * batch:9.0f} rows/s "
                  f"(BLAS threads {base['blas_threads']}; the other: "
                  f"{base['qps_other_blas'] * batch:.0f})", flush=True)
            body, header = rest_body(*requests[0])
            rest_file = os.path.join(root, f"rest{batch}.bin")
            grpc_file = os.path.join(root, f"grpc{batch}.bin")
            with open(rest_file, "wb") as f:
                f.write(body)
            message = grpc_body(*requests[0])
            with open(grpc_file, "wb") as f:
                f.write(message)
            h2_file = os.path.join(root, f"h2_{batch}.bin")
            with open(h2_file, "wb") as f:  # gRPC framing: uncompressed, big-endian length
                f.write(b"\0" + len(message).to_bytes(4, "big") + message)
            bodies[batch] = (rest_file, header, grpc_file, h2_file)
        servers = {}
        try:
            # both servers up at once, taking turns cell by cell, round after round: the
            # machine is shared, so batching off and on are measured back to back, and each
            # cell's median over the rounds is reported
            for batching, extra in (("off", ["--max-batch-size", 1]),
                                    ("on", ["--max-batch-size", args.max_batch_size,
                                            "--max-queue-delay-us", args.max_queue_delay_us])):
                servers[batching] = Server(path, "--poll-seconds", 0, *extra)
            for server in servers.values():  # warm-up, not measured: first calls compile
                for batch in BATCHES:
                    rest_file, header, grpc_file, _ = bodies[batch]
                    drive_rest(wrk, server.port, rest_file, header, args.clients, 1, root)
                    drive_grpc(server.grpc_port, grpc_file, args.clients, 1)
            tools = {"wrk": wrk, "h2load": h2load}
            for batch in BATCHES:
                requests = make_requests(batch, max(8, 4096 // batch), seed=batch)
                adjacent, cells = [], {}
                for _ in range(args.rounds):
                    # the baseline again in every round: each cell is compared with the
                    # in-process rate measured next to it
                    adjacent.append(in_process_one_thread(path, requests, args.seconds))
                    print(f"in-process batch {batch:3d}: "
                          f"{adjacent[-1]['qps'] * batch:9.0f} rows/s", flush=True)
                    for proto in PROTOCOLS:
                        for batching, server in servers.items():
                            r = measure_cell(server, proto, bodies[batch], args.clients,
                                             args.seconds, tools, root)
                            cells.setdefault((proto, batching), []).append(r)
                            latency = f"mean {r['mean_ms']:.1f} ms" if r.get("mean_ms") else \
                                f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms"
                            print(f"{proto + ', batching ' + batching:32s} batch {batch:3d} "
                                  f"x{args.clients}: {r['qps'] * batch:9.0f} rows/s, {latency}, "
                                  f"{r['failed']} failed; CPU per request: server "
                                  f"{r['server_cpu_ms']:.3f} ms, client "
                                  f"{r['client_cpu_ms']:.3f} ms", flush=True)
                base = median_cell(adjacent)
                rows.append({"mode": "in-process, 1 thread (next to the cells below)",
                             "batch": batch, "clients": 1, **base,
                             "rows_per_s": base["qps"] * batch})
                for batching in servers:
                    for proto in PROTOCOLS:
                        r = median_cell(cells[(proto, batching)])
                        row = {"mode": f"{proto}, batching {batching}", "batch": batch,
                               "clients": args.clients, **r, "rows_per_s": r["qps"] * batch,
                               "vs_in_process": r["qps"] / base["qps"]}
                        rows.append({k: v for k, v in row.items() if v is not None})
        finally:
            for server in servers.values():
                server.close()
        # under load while training publishes: snapshots switch, no request fails
        server = Server(path, "--poll-seconds", 0.5, "--max-batch-size", args.max_batch_size)
        try:
            import tritonclient.http as httpclient

            trainer = train(path, "--steps", args.steps + 400, "--snapshot-interval", 5,
                            "--keep-snapshots", 1, "--resume", wait=False)
            seen, probe_failures = set(), []
            stop = threading.Event()

            def probe():  # which snapshot answers, a few times a second
                client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
                a = httpclient.InferInput("keys", [4], "INT64")
                a.set_data_from_numpy(np.arange(4, dtype=np.int64))
                while not stop.wait(0.05):
                    try:
                        seen.add(client.infer("embedding", [a]).get_response()["parameters"]
                                 ["snapshot"])
                    except Exception as e:  # counted: the test is that none fail
                        probe_failures.append(repr(e))

            watcher = threading.Thread(target=probe, daemon=True)
            watcher.start()
            deadline = time.monotonic() + 300
            while len(seen) < 2 and time.monotonic() < deadline and trainer.poll() is None:
                time.sleep(0.1)  # until the resumed run has published its first checkpoint
            rest_file, header = bodies[64][:2]
            r = drive_rest(wrk, server.port, rest_file, header, args.clients,
                           max(args.seconds, 10.0), root)
            stop.set()
            watcher.join()
            trainer.terminate()
            trainer.wait()
        finally:
            server.close()
        rows.append({"mode": "REST, batching on, training publishing", "batch": 64,
                     "clients": args.clients, "qps": r["qps"], "rows_per_s": r["qps"] * 64,
                     "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
                     "failed": r["failed"] + len(probe_failures), "snapshots_served": len(seen)})
        print(f"during reload: {r['qps'] * 64:.0f} rows/s, p99 {r['p99_ms']:.1f} ms, {len(seen)} "
              f"snapshots served, {r['failed'] + len(probe_failures)} failed", flush=True)
    columns = ["mode", "batch", "clients", "rounds", "rows_per_s", "qps", "p50_ms", "p99_ms",
               "mean_ms", "vs_in_process", "server_cpu_ms", "client_cpu_ms", "cpu_ms_per_request",
               "snapshots_served", "failed"]
    print(markdown_table(rows, columns))

    def rate(mode, batch):
        return next(x["rows_per_s"] for x in rows if x["mode"] == mode and x["batch"] == batch)

    def ratio(mode, batch):
        return next(x["vs_in_process"] for x in rows if x["mode"] == mode and x["batch"] == batch)

    goals = {
        "REST batch 64 / in-process one thread next to it (goal >= 0.8)":
            max(ratio("REST, batching off", 64), ratio("REST, batching on", 64)),
        "gRPC / REST at batch 64, batching on (goal >= 1)":
            rate("gRPC, batching on", 64) / rate("REST, batching on", 64),
        "gRPC / REST at batch 1, batching on (goal >= 1)":
            rate("gRPC, batching on", 1) / rate("REST, batching on", 1),
        "batch 1 x clients, batching on / off, REST (goal >= 5)":
            rate("REST, batching on", 1) / rate("REST, batching off", 1),
        "batch 1 x clients, batching on / off, gRPC (goal >= 5)":
            rate("gRPC, batching on", 1) / rate("gRPC, batching off", 1),
    }

    def cell(mode, batch):
        return next(x for x in rows if x["mode"] == mode and x["batch"] == batch)

    # where a batch-1 request's server CPU goes with batching on, against what 5x would need
    # (a merged row's model cost: the cheapest 64-row forward measured in process)
    model_row = min(x["cpu_ms_per_request"] for x in rows
                    if x["mode"].startswith("in-process") and x["batch"] == 64) / 64
    costs = {}
    for proto in ("REST", "gRPC"):
        off, on = cell(f"{proto}, batching off", 1), cell(f"{proto}, batching on", 1)
        c = costs[proto] = batching_costs(off["server_cpu_ms"], on["server_cpu_ms"], model_row)
        print(f"{proto} batch 1: the server spends {c['server_cpu_ms_batching_off']:.3f} ms of CPU "
              f"per request with batching off, {c['server_cpu_ms_batching_on']:.3f} ms with it on "
              f"({c['cpu_gain']:.2f}x less), of which the model {model_row:.4f} ms and the "
              f"request's own handling {c['request_handling_ms_batching_on']:.3f} ms; 5x the "
              f"rows/s of batching off needs at most {c['server_cpu_ms_for_5x']:.3f} ms",
              flush=True)
    for what, value in goals.items():
        print(f"{what}: {value:.2f}")
    # what the stacks themselves cost (an empty handler each): gRPC's floor against the whole
    # REST request bounds gRPC / REST on this machine
    with tempfile.TemporaryDirectory(prefix="serve_floors_", dir=args.dir) as folder:
        floors = measure_floors(wrk, h2load, args.clients, args.seconds, folder)
    rest_request = cell("REST, batching on", 1)["server_cpu_ms"]
    print(f"the stacks alone (empty handlers, same load generators): REST "
          f"{floors['REST']['server_cpu_ms']:.3f} ms, gRPC {floors['gRPC']['server_cpu_ms']:.3f} "
          f"ms of server CPU per request; a whole batch-1 REST request (batching on) "
          f"{rest_request:.3f} ms", flush=True)
    print("wrote", save_result("serve", {"machine": machine, "config": config, "rows": rows,
                                         "ratios": goals, "batching_costs": costs,
                                         "stack_floors": floors}))


if __name__ == "__main__":
    main()
