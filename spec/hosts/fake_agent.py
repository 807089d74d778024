#!/usr/bin/env python3
"""fake_agent.py — a scripted `transom agent` for spec/agent_gen_spec.lua.

It speaks the agent's side of the operator protocol (core/fleet/agent.c):
answers the job secret's challenge (HMAC-SHA256(secret, "transom-auth-v1" ||
nonce), core/base/auth.h), registers (AGENT ...), heartbeats, and answers
SPAWN / KILL lines with STARTED / EXITED lines chosen by the test instead of
starting workers, so it can send what a real agent sends only in a race: an
older worker's late EXITED or STARTED after the operator placed a new one.

  fake_agent.py PORT SECRET_FILE LOG CMD_FILE

Every line the operator sends is appended to LOG. Lines the test appends to
the file CMD_FILE (polled every 0.1 s) are sent to the operator as they are,
each once. Bounded: exits after 120 s
or when the operator closes the connection.
"""
import hashlib
import hmac
import os
import socket
import sys
import time


def main():
    port, secret_file, log_path, cmd_path = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    key = bytes.fromhex(open(secret_file).read().strip())
    s = socket.create_connection(("127.0.0.1", int(port)), timeout=10)
    ch = b""
    while len(ch) < 20:
        part = s.recv(20 - len(ch))
        if not part:
            sys.exit("fake_agent: the operator closed before its challenge")
        ch += part
    if ch[:4] != b"TRAU":
        sys.exit("fake_agent: not a challenge: %r" % ch[:4])
    s.sendall(hmac.new(key, b"transom-auth-v1" + ch[4:], hashlib.sha256).digest())
    s.sendall(b"AGENT name=fake addr=127.0.0.1 cores=2 gpus=0 slots=2 pid=%d\n" % os.getpid())
    s.settimeout(0.1)
    buf, sent, t_end, t_hb = b"", 0, time.time() + 120, 0.0
    with open(log_path, "a", buffering=1) as log:
        while time.time() < t_end:
            try:
                part = s.recv(65536)
                if not part:
                    return
                buf += part
            except socket.timeout:
                pass
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                log.write(line.decode(errors="replace") + "\n")
            if time.time() - t_hb > 0.5:
                s.sendall(b"HB n=0\n")
                t_hb = time.time()
            try:
                cmds = open(cmd_path, "rb").read().split(b"\n")
            except OSError:
                cmds = []
            cmds = [c for c in cmds if c]
            for c in cmds[sent:]:
                s.sendall(c + b"\n")
            sent = max(sent, len(cmds))


if __name__ == "__main__":
    main()
