#!/usr/bin/env python3
"""Load for scripts/bench-serve.sh: C concurrent clients, each on its own keep-alive
connection, POST single sentences to a LibreTranslate-style /translate for S seconds (lines
taken round robin from a file); prints one JSON line: sentences/s, p50/p99 latency in ms,
errors, and the server's resident memory (kB) sampled every 10 s when --pid is given.
    serve-load.py URL LINES_FILE --clients C --seconds S [--source de --target en] [--pid PID]
"""
import argparse
import http.client
import itertools
import json
import threading
import time
import urllib.parse


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("lines")
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--source", default="de")
    ap.add_argument("--target", default="en")
    ap.add_argument("--pid", type=int)
    a = ap.parse_args()
    url = urllib.parse.urlparse(a.url)
    lines = [l.rstrip("\n") for l in open(a.lines, encoding="utf-8") if l.strip()]
    counter = itertools.count()
    lock = threading.Lock()
    latencies, errors = [], []
    stop_at = time.monotonic() + a.seconds

    def client():
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        while time.monotonic() < stop_at:
            q = lines[next(counter) % len(lines)]
            body = json.dumps({"q": q, "source": a.source, "target": a.target})
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/translate", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                ok = resp.status == 200 and "translatedText" in json.loads(data)
            except Exception as e:  # a refused or dropped connection counts as an error
                ok, data = False, repr(e).encode()
                conn.close()
                conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
            took = time.perf_counter() - t0
            with lock:
                if ok:
                    latencies.append(took)
                else:
                    errors.append(data[:200].decode("utf-8", "replace"))
        conn.close()

    rss = []

    def sampler():
        while time.monotonic() < stop_at:
            rss.append(rss_kb(a.pid))
            time.sleep(min(10, max(0, stop_at - time.monotonic())))

    threads = [threading.Thread(target=client) for _ in range(a.clients)]
    if a.pid:
        threads.append(threading.Thread(target=sampler))
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    latencies.sort()
    pct = lambda p: round(1e3 * latencies[min(len(latencies) - 1, int(p * len(latencies)))], 1) if latencies else None
    out = {
        "clients": a.clients,
        "sentences": len(latencies),
        "sent_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "mean_ms": round(1e3 * sum(latencies) / len(latencies), 1) if latencies else None,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }
    if a.pid:
        rss.append(rss_kb(a.pid))
        out["rss_kb"] = rss
    print(json.dumps(out))


if __name__ == "__main__":
    main()
