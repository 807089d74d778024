#!/usr/bin/env python3
"""make_corpus.py — writes the fuzz targets' seed corpora (spec/fuzz/corpus/).

A handful of valid and near-valid inputs per target, built here from the
formats' descriptions (ftar_wire.h, proto.h, job.lua, safetensors.h, ckpt.c's
encode_manifest, json_top.h) so that they can be re-made when a format
changes. The seeds are checked in; run.sh fuzzes a copy of them and never
writes here.
Regression inputs for crashes found are added by hand under
corpus/<target>/regress-* and are kept when this script runs again.

    python3 spec/fuzz/make_corpus.py
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# --- FTAR frames (ftar_wire.h) ---

FT = dict(HELLO=1, WELCOME=2, REJECT=3, BYE=4, HEARTBEAT=5, EPOCH=6, SYNC=7, GO=8, ABORT=9, LEAVE=10,
          COMMID=11, CONNECT=32, DATA=33, TOKEN=34)


def frame(type_, payload=b"", flags=0, epoch=1, seq=0, index=0, aux=0, length=None, magic=b"FTAR", crc=None):
    n = len(payload) if length is None else length
    hdr = magic + struct.pack("<HHQQIII", type_, flags, epoch, seq, index, n, aux)
    if crc is None:
        crc = crc32c(hdr, crc32c(payload)) if payload else crc32c(hdr)
    return hdr + struct.pack("<I", crc) + payload


def ftar_seeds():
    dm = lambda n: struct.pack("<I", n)  # data_max prefix
    host = b"127.0.0.1"
    hello = struct.pack("<IHH", 1, 40001, len(host)) + host.ljust(48, b"\0")
    welcome = struct.pack("<QII", 0x1234, 3000, 500)
    entry = lambda slot, port, uid: struct.pack("<IHHQ", slot, port, len(host), uid) + host.ljust(48, b"\0")
    epoch = struct.pack("<I", 2) + entry(0, 40001, 11) + entry(1, 40002, 12)
    floats = struct.pack("<16f", *[float(i) for i in range(16)])
    connect = struct.pack("<QIIIIQ", 11, 4242, 7, 1 << 20, 0, 0xABCDEF)
    w = lambda name, data: write("ftar_frame", name, data)
    w("hello", dm(0) + frame(FT["HELLO"], hello, index=0))
    w("coord_to_member", dm(0) + frame(FT["WELCOME"], welcome) + frame(FT["EPOCH"], epoch, epoch=2)
      + frame(FT["GO"], epoch=2, seq=5, index=1) + frame(FT["COMMID"], bytes(range(128)), epoch=2))
    w("member_to_coord", dm(0) + frame(FT["HEARTBEAT"], epoch=2, index=1) + frame(FT["SYNC"], epoch=2, seq=5, flags=2)
      + frame(FT["ABORT"], epoch=2, seq=5) + frame(FT["LEAVE"], seq=5))
    w("ring", dm(64) + frame(FT["CONNECT"], connect, flags=8, epoch=2, index=0, aux=1)
      + frame(FT["DATA"], floats, epoch=2, seq=5, index=0, aux=16) + frame(FT["TOKEN"], epoch=2, seq=5, index=1))
    w("reject_bye", dm(0) + frame(FT["REJECT"], b"slot 1 is taken", index=3) + frame(FT["BYE"], b"evicted: lapsed"))
    # near-valid
    good = frame(FT["HELLO"], hello)
    w("bad_crc", dm(0) + good[:50] + bytes([good[50] ^ 1]) + good[51:])
    w("too_long", dm(0) + frame(FT["HELLO"], hello + b"!"))
    w("bad_magic", dm(0) + frame(FT["HELLO"], hello, magic=b"FTAX"))
    w("truncated", dm(0) + frame(FT["EPOCH"], epoch, epoch=3)[:100])
    w("unknown_type", dm(0) + frame(12, b"x"))
    w("data_over_max", dm(16) + frame(FT["DATA"], floats, aux=16))


# --- control lines (proto.h); byte 0: line buffer, byte 1: how the stream is cut ---

def step_line(step, checksum=True):
    kv = dict(step=step, worker=1, replicas=2, epoch=3, redos=0, leader=0, skipped=0, loss=2.5, grad_norm=0.75,
              lr=0.001, step_s=0.125, data_s=0.001, forward_s=0.05, backward_s=0.06, allreduce_s=0.01,
              optimizer_s=0.004, ckpt_wait_s=0, tokens_per_s=6144, rss_bytes=123456789)
    s = " ".join("%s=%s" % (k, v) for k, v in kv.items())
    return s + (" checksum=89abcdef" if checksum else "")


def proto_seeds():
    w = lambda name, b0, b1, text: write("proto", name, bytes([b0, b1]) + text.encode())
    w("worker_to_operator", 4, 7,
      "HELLO slot=0 pid=1234\nREADY donor=127.0.0.1:4000 step=10 state_s=0.5\nSTEP slot=0 " + step_line(11)
      + "\nHB phase=forward for=1.5\nEVAL step=100 val=2.3\nCKPT what=committed%20step%20100\nFIRED at=50\n")
    w("operator_to_worker", 4, 3,
      "WELCOME run=runs/x coord=127.0.0.1:5000 mode=join donor=127.0.0.1:4001 threads=2 resume_step=0\n"
      "SET lr=0.001 at=5\nCHAOS at=10 fault=kill ms=200 steps=0\nSTOP at=100\nSKIP at=7\nCKPT_NOW\nBYE\n")
    w("donor", 5, 1, "SNAP step=10 opt_steps=10 n=5 data_skip=3 skips=1,2,3\nGRADS from=3\nGONE first=1 count=2\n"
      "GRADS first=4 count=3\n")
    w("escapes", 4, 0, "REFUSE why=slot%201%20is%20taken%25%0A%3d%zz%4\nCKPT what=%\n")
    w("odd_lines", 3, 9, "STEP step=1 loss=nan grad_norm=-inf lr=1e999 checksum=-1\r\n\n\n =x  a= b==c\nHB phase=x")
    w("long_line", 4, 200, "STEP " + "x" * 4200 + "\nHB\n")
    w("small_buffer", 2, 5, "STEP step=123456789012 loss=1\nHB\n")
    w("step_no_checksum", 4, 2, "STEP slot=1 " + step_line(7, checksum=False) + "\n")


# --- job files (lua/transom/job.lua) ---

def job_seeds():
    w = lambda name, text: write("job", name, text)
    w("minimal.lua", 'return { data = "data/fortunes.txt" }\n')
    with open(os.path.join(HERE, "..", "..", "examples", "fortunes.lua")) as f:
        w("fortunes.lua", f.read())
    w("fleet.lua", '''-- replicas, a checkpoint policy and chaos
local layers = 2
return {
  name = "fleet", data = "data/fortunes.txt", n_layer = layers * 2, n_head = 2, n_embd = 32,
  replicas = 3, min_replicas = 2, max_replicas = 4, on_failure = "restart_all", deadline = 1.5,
  checkpoint = { every_steps = 10, keep_last = 2, when_busy = "coalesce" },
  chaos = { { at_step = 5, replica = 1, fault = "kill" }, { at_step = 9, replica = 2, fault = "slow", ms = 50 } },
  sample_prompt = "\\0a\\r%q", precision = "bf16", device = "emu", lr = 3e-4, min_lr = 0,
}
''')
    w("sets.lua", 'return { data = "x" }\n\0lr=0.01\ncheckpoint.every_steps=10\nreplicas=2\ndetector=false')
    w("misspelled.lua", 'return { data = "d", learning_rate = 1e-3, [1] = 2 }\n')
    w("bad_type.lua", 'return { data = 5, n_layer = 1.5 }\n')
    w("bad_global.lua", 'return { data = os.getenv("HOME") .. tostring(undefined_thing) }\n')
    w("syntax.lua", 'return { data = "d",, }\n')
    w("not_table.lua", 'return ("x"):rep(3)\n')
    w("runaway.lua", 'local n = 0\nwhile true do n = n + 1 end\n')
    w("runaway_pcall.lua", 'while true do pcall(function() while true do end end) end\n')
    w("big_string.lua", 'local s = ("x"):rep(1e10)\nreturn { data = s }\n')
    w("strings.lua", 'local t = {}\nfor w in ("a b c"):gmatch("%a") do t[#t + 1] = w:upper() end\n'
      'return { data = table.concat(t, "/"), name = string.format("%q", "n\\n"), seed = math.maxinteger }\n')


# --- safetensors (safetensors.h; laid out as safetensors_write does) ---

def safetensors(tensors, meta=None, pad=True, header=None):
    h = {"__metadata__": dict({"format": "pt"}, **(meta or {}))}
    data = b""
    for name, shape, values in tensors:
        raw = struct.pack("<%df" % len(values), *values)
        h[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = header if header is not None else json.dumps(h, separators=(",", ":"))
    raw_h = text.encode()
    if pad:
        raw_h += b" " * (-len(raw_h) % 8)
    return struct.pack("<Q", len(raw_h)) + raw_h + data


def safetensors_seeds():
    w = lambda name, data: write("safetensors", name, data)
    w("two_tensors", safetensors([("a.weight", [2, 3], [0.5] * 6), ("b", [4], [1, 2, 3, 4])]))
    w("metadata", safetensors([("x", [1], [7])], meta={"step": "100", "q\"uote": "back\\slash\n"}))
    w("empty", safetensors([]))
    w("scalar_and_zero", safetensors([("s", [], [3.25]), ("z", [0, 5], [])]))
    w("spaces", struct.pack("<Q", 56) + b' { "t" : { "shape" : [ 1 ] , "data_offsets" : [0,4], "dtype":"F32" } }  '
      + b"\0\0\x80\x3f")
    # near-valid
    w("bad_offsets", safetensors([], header='{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}')
      + b"\0" * 8)
    w("f16", safetensors([], header='{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}') + b"\0" * 4)
    w("header_too_long", struct.pack("<Q", 1 << 40) + b"{}")
    w("duplicate_name", safetensors([], header='{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                             '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},'
                                             '"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}') + b"\0" * 8)
    w("too_many_dims", safetensors([], header='{"a":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],'
                                              '"data_offsets":[0,4]}}') + b"\0" * 4)


# --- checkpoint manifests (ckpt.c encode_manifest; host byte order) ---

def manifest(tensors, step=100, nt=None, chunk=16 << 20, version=1, seal=True):
    b = struct.pack("<IIqQqQd", 0x4B435254, version, step, 0xDEADBEEF, step, 0x1234, 1.7e9)
    b += struct.pack("<IQ", len(tensors) if nt is None else nt, chunk)
    for name, dtype, dims, nbytes, crc in tensors:
        b += struct.pack("<H", len(name)) + name + struct.pack("<BB", dtype, len(dims))
        b += b"".join(struct.pack("<q", d) for d in dims) + struct.pack("<QI", nbytes, crc)
    return b + struct.pack("<I", crc32c(b)) if seal else b


def ckpt_seeds():
    w = lambda name, data: write("ckpt_manifest", name, data)
    model = [(b"wte", 0, [65, 32], 65 * 32 * 4, 0x11111111), (b"h.0.attn.w", 0, [32, 96], 32 * 96 * 4, 0x22),
             (b"opt.m.wte", 0, [65, 32], 65 * 32 * 4, 0x33), (b"rng", 1, [16], 16, 0x44)]
    w("model", manifest(model))
    w("model_unsealed", manifest(model, seal=False))  # the harness seals it
    w("empty", manifest([]))
    w("empty_unsealed", manifest([], seal=False))
    # near-valid
    w("bad_version", manifest(model[:1], version=2))
    w("count_too_big", manifest(model[:1], nt=1000000, seal=False))
    w("name_too_long", manifest([(b"n" * 130, 0, [1], 4, 0)], seal=False))
    w("too_many_dims", manifest([(b"t", 0, [1, 1, 1, 1, 1], 4, 0)], seal=False))
    w("chunk_zero", manifest(model[:1], chunk=0, seal=False))
    w("truncated", manifest(model, seal=False)[:-7])


# --- top-level JSON keys (json_top.h); byte 0: the key's length, then the key, then the text ---

def json_top(key, text):
    key, text = (key.encode() if isinstance(key, str) else key), (text.encode() if isinstance(text, str) else text)
    return bytes([len(key)]) + key + text


def json_top_seeds():
    w = lambda name, data: write("json_top", name, data)
    config = json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 300,
                         "n_positions": 64, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_inner": None,
                         "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05,
                         "tie_word_embeddings": True, "task_specific_params": {"n_layer": 7}}, indent=2)
    w("config", json_top("n_layer", config))
    w("config_eps", json_top("layer_norm_epsilon", config))
    w("config_act", json_top("activation_function", config))
    w("vocab_bytes", json_top("tokens", '{"type":"bytes","tokens":[10,32,33,39,44]}'))
    w("vocab_tokens", json_top("type", '{"type":"tokens","vocab_size":50257}'))
    w("escapes", json_top("n", '{"s": "\\"n\\": 1 \\u00e9 \\ud83d\\ude00 \\ud800", "\\u006e": -0.5e-3}'))
    w("bom", json_top("n", b"\xef\xbb\xbf {\"n\": true}"))
    w("numbers", json_top("n", '{"a": -9223372036854775808, "b": 1e400, "c": 1e-400, "n": 9223372036854775807}'))
    w("nested", json_top("n", '{"a": [[[{"n": [1, {"n": null}]}]]], "n": false}'))
    w("long_key", json_top("k" * 255, '{"' + "k" * 255 + '": "x", "' + "k" * 300 + '": 1}'))
    # near-valid
    w("twice", json_top("n", '{"n": 1, "m": 2, "n": 3}'))
    w("cut", json_top("n", '{"n": "ab\\'))
    w("trailing", json_top("n", '{"n": 1} {}'))
    w("deep", json_top("n", '{"a": ' + "[" * 65 + "]" * 65 + ', "n": 1}'))
    w("nul", json_top("n", b'{"n": "a\0b"}'))


if __name__ == "__main__":
    ftar_seeds()
    proto_seeds()
    job_seeds()
    safetensors_seeds()
    ckpt_seeds()
    json_top_seeds()
