"""An outsider at a TCPStore port: plain Python + torch's stock client, no secret.

Run by path (``python tests/outsider/store_client.py``); reads one JSON command
per line on stdin and answers one JSON line on stdout::

    {"op": "list", "host": "127.0.0.1", "port": 4242}        -> {"keys": {key: value}}
    {"op": "set", "host": ..., "port": ..., "key": k, "value": v}
    {"op": "delete", "host": ..., "port": ..., "key": k}     -> {"deleted": true}
    {"op": "copy", "host": ..., "port": ..., "src": k, "dst": k2}   (replay a value)
    {"op": "blast", "host": ..., "port": ..., "bytes": n}    -> {"sent": m} (raw bytes, no
                                                                 client: what got through)

``timeout_s`` (default 5) bounds torch's client, which retries its connect until then.

It imports nothing of the project: what it can do, anyone who reaches the port can.
"""

import datetime
import json
import socket
import sys

import torch.distributed as dist


def client(cmd):
    return dist.TCPStore(cmd["host"], cmd["port"], is_master=False,
                         timeout=datetime.timedelta(seconds=cmd.get("timeout_s", 5)))


def blast(cmd):
    """Send ``bytes`` zero bytes down one raw connection; how many went before it broke."""
    sock = socket.create_connection((cmd["host"], cmd["port"]), timeout=10)
    chunk, sent = bytes(1 << 20), 0
    try:
        while sent < cmd["bytes"]:
            sent += sock.send(chunk[:cmd["bytes"] - sent])
    except OSError:
        pass
    finally:
        sock.close()
    return {"sent": sent}


def run(cmd):
    op = cmd["op"]
    if op == "blast":
        return blast(cmd)
    store = client(cmd)
    if op == "list":
        keys = store.list_keys()
        return {"keys": {k: bytes(store.get(k)).decode("latin-1") for k in keys}}
    if op == "set":
        store.set(cmd["key"], cmd["value"])
        return {"set": cmd["key"]}
    if op == "delete":
        return {"deleted": bool(store.delete_key(cmd["key"]))}
    if op == "copy":
        store.set(cmd["dst"], store.get(cmd["src"]))
        return {"copied": cmd["dst"]}
    raise ValueError(f"unknown op {op!r}")


def main():
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            out = run(json.loads(line))
        except Exception as exc:  # report, keep serving
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
