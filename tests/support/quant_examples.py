"""Small quantized safetensors checkpoints of every convention, with float64 reference norms.

Adapted for the tests from the example generator written for this project (issue 16's
research): each convention's producer is imitated from its documented names, dtypes,
shapes and formulas, and a reference dequantizer that reads only the files (its own
code, independent of tclip's) gives the real weights' norms in ``expected.json``.

    build(root)            -> {name: folder} for every convention, single file and sharded
    build(root, ["ct_nvfp4"])
    python tests/support/quant_examples.py DIR [NAME...]     (the same from a shell)

Each ``<name>/`` holds ``model.safetensors`` + ``config.json`` (+ ``hf_quant_config.json``);
``<name>_sharded/`` the same tensors in two shards with an index, every weight's codes in
shard 1 and its scales in shard 2. The random numbers are seeded: the same bytes every time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct

import ml_dtypes as mld
import numpy as np

# --------------------------------------------------------------------------------------
# safetensors I/O (own minimal writer/reader so that every dtype string is under control)
# --------------------------------------------------------------------------------------

NP_OF = {  # safetensors dtype string -> numpy dtype used to hold the raw elements
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(mld.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype(mld.float8_e4m3fn), "F8_E5M2": np.dtype(mld.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(mld.float8_e4m3fnuz), "F8_E5M2FNUZ": np.dtype(mld.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(mld.float8_e8m0fnu),
}


class T:
    """A stored tensor: safetensors dtype string + numpy array holding exactly those bytes."""

    def __init__(self, dtype: str, arr: np.ndarray):
        arr = np.asarray(arr)
        arr = arr if arr.flags.c_contiguous else arr.copy(order="C")  # keeps 0-d shape []
        want = NP_OF[dtype]
        if arr.dtype != want:
            if arr.dtype.itemsize == want.itemsize and arr.dtype.kind in "ui" and want.kind not in "ui":
                arr = arr.view(want)  # raw bit patterns given as integers
            else:
                arr = arr.astype(want)
        self.dtype, self.arr = dtype, arr

    @property
    def shape(self):
        return list(self.arr.shape)


def _load_json(path: str):
    with open(path) as handle:
        return json.load(handle)


def _dump_json(data, path: str, **kwargs) -> None:
    with open(path, "w") as handle:
        json.dump(data, handle, **kwargs)


def st_write(path: str, tensors: dict[str, T], metadata: dict | None = None) -> None:
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    blobs, off = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        b = t.arr.tobytes()
        header[name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def st_read(path: str) -> dict[str, T]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dt = NP_OF[info["dtype"]]
        arr = np.frombuffer(data[a:b], dtype=dt).reshape(info["shape"])
        out[name] = T(info["dtype"], arr)
    return out


def load_dir(d: str) -> tuple[dict[str, T], dict[str, str]]:
    """All tensors of a checkpoint directory (single file or sharded via index)."""
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        wm = _load_json(idx)["weight_map"]
        files = sorted(set(wm.values()))
    else:
        files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    tensors, where = {}, {}
    for fn in files:
        for k, v in st_read(os.path.join(d, fn)).items():
            tensors[k] = v
            where[k] = fn
    return tensors, where


# --------------------------------------------------------------------------------------
# number formats
# --------------------------------------------------------------------------------------

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)
E4M3_MAX, E2M1_MAX = 448.0, 6.0


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """Round (RNE, saturating) float64 -> float8_e4m3fn array."""
    return np.clip(np.asarray(x, np.float64), -E4M3_MAX, E4M3_MAX).astype(mld.float8_e4m3fn)


def f64(t) -> np.ndarray:
    a = t.arr if isinstance(t, T) else t
    return a.astype(np.float64)


def fp4_codes(x: np.ndarray) -> np.ndarray:
    """float -> 4-bit E2M1 codes (bit3 = sign, bits0-2 = magnitude index), RNE, saturating."""
    q = np.clip(np.asarray(x, np.float64), -E2M1_MAX, E2M1_MAX).astype(mld.float4_e2m1fn)
    return q.view(np.uint8) & 0x0F  # ml_dtypes keeps one E2M1 value per byte, low nibble


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack along the last axis: element 2k -> LOW nibble, element 2k+1 -> HIGH nibble."""
    c = codes.astype(np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    p = packed.astype(np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = p & 0x0F
    out[..., 1::2] = p >> 4
    return out


def e8m0_value(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    v = np.ldexp(1.0, b - 127).astype(np.float64)
    return np.where(b == 255, np.nan, v)


def bf16(x) -> np.ndarray:
    return np.asarray(x, np.float64).astype(mld.bfloat16)


def f32(x) -> np.ndarray:
    return np.asarray(x, np.float64).astype(np.float32)


# --------------------------------------------------------------------------------------
# tiny model skeletons (names as the HF checkpoints spell them)
# --------------------------------------------------------------------------------------

RNG = np.random.default_rng(20240917)


def randw(shape, scale=0.05):
    w = RNG.standard_normal(shape) * scale
    # a few outliers so that block/group scales differ
    m = RNG.random(shape) < 0.002
    w[m] *= 12.0
    return w


def llama_layout(H=256, I=512, KV=64, V=96, L=2):
    """(name, shape, quantizable) for a Llama-like decoder."""
    out = [("model.embed_tokens.weight", (V, H), False)]
    for l in range(L):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", (H,), False),
                (p + "self_attn.q_proj.weight", (H, H), True),
                (p + "self_attn.k_proj.weight", (KV, H), True),
                (p + "self_attn.v_proj.weight", (KV, H), True),
                (p + "self_attn.o_proj.weight", (H, H), True),
                (p + "post_attention_layernorm.weight", (H,), False),
                (p + "mlp.gate_proj.weight", (I, H), True),
                (p + "mlp.up_proj.weight", (I, H), True),
                (p + "mlp.down_proj.weight", (H, I), True)]
    out += [("model.norm.weight", (H,), False), ("lm_head.weight", (V, H), False)]
    return out


FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         ("mlp.gate_proj", "mlp.up_proj"))


def fused_groups(module_names):
    """Groups of modules a consumer (vLLM) fuses and that must share a per-tensor scale."""
    groups, seen = [], set()
    for m in module_names:
        for g in FUSED:
            for s in g:
                if m.endswith(s):
                    pref = m[: -len(s)]
                    grp = tuple(pref + x for x in g if pref + x in module_names)
                    if grp not in seen:
                        seen.add(grp)
                        groups.append(grp)
    grouped = {m for g in groups for m in g}
    return groups + [(m,) for m in module_names if m not in grouped]


def base_config(H, I, KV, V, L, arch="LlamaForCausalLM", model_type="llama"):
    return {"architectures": [arch], "model_type": model_type, "hidden_size": H,
            "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": H // 64,
            "num_key_value_heads": KV // 64 if KV >= 64 else 1, "vocab_size": V,
            "torch_dtype": "bfloat16", "tie_word_embeddings": False}


# --------------------------------------------------------------------------------------
# producers: return (tensors, config, hf_quant_config or None, originals)
#   originals: weight name -> float64 array of the unquantized weight (for sanity checks)
# --------------------------------------------------------------------------------------


def plain(name, shape, originals, dtype="BF16", scale=0.05):
    w = randw(shape, scale) if len(shape) > 1 else 1.0 + 0.1 * RNG.standard_normal(shape)
    t = T(dtype, w)
    originals[name] = f64(t)
    return t


def fp8_block_quant(w: np.ndarray, bs=(128, 128), ue8m0=False):
    """DeepSeek/HF 'fp8' block quantization: pad to bs, per-block amax/448, codes = w/s."""
    out, inn = w.shape
    R, C = math.ceil(out / bs[0]), math.ceil(inn / bs[1])
    pad = np.zeros((R * bs[0], C * bs[1]))
    pad[:out, :inn] = w
    blk = pad.reshape(R, bs[0], C, bs[1])
    amax = np.abs(blk).max(axis=(1, 3))
    s = np.where(amax > 0, amax / E4M3_MAX, 1.0)
    if ue8m0:
        s = np.exp2(np.ceil(np.log2(s)))
    s = f32(s)  # weight_scale_inv is F32
    full = np.repeat(np.repeat(s.astype(np.float64), bs[0], 0), bs[1], 1)[:out, :inn]
    return to_e4m3(w / full), s


def make_deepseek_fp8(ue8m0=False):
    """DeepSeek-V3 style: quant_method fp8, weight + weight_scale_inv (F32, ceil blocks)."""
    H, V, QL, KVA, QB, KVL, KVB, OI, I, EI, E = 320, 96, 192, 160, 256, 128, 384, 256, 448, 192, 4
    originals, t = {}, {}
    lay = [("model.embed_tokens.weight", (V, H), False)]
    for l in range(2):
        p = f"model.layers.{l}."
        lay += [(p + "input_layernorm.weight", (H,), False),
                (p + "self_attn.q_a_proj.weight", (QL, H), True),
                (p + "self_attn.q_a_layernorm.weight", (QL,), False),
                (p + "self_attn.q_b_proj.weight", (QB, QL), True),
                (p + "self_attn.kv_a_proj_with_mqa.weight", (KVA, H), True),   # 160 rows: ragged
                (p + "self_attn.kv_a_layernorm.weight", (KVL,), False),
                (p + "self_attn.kv_b_proj.weight", (KVB, KVL), True),
                (p + "self_attn.o_proj.weight", (H, OI), True),
                (p + "post_attention_layernorm.weight", (H,), False)]
        if l == 0:  # dense layer
            lay += [(p + "mlp.gate_proj.weight", (I, H), True), (p + "mlp.up_proj.weight", (I, H), True),
                    (p + "mlp.down_proj.weight", (H, I), True)]
        else:       # MoE layer: router stays BF16, experts are FP8
            lay += [(p + "mlp.gate.weight", (E, H), False)]
            for e in [f"experts.{i}" for i in range(E)] + ["shared_experts"]:
                lay += [(p + f"mlp.{e}.gate_proj.weight", (EI, H), True),
                        (p + f"mlp.{e}.up_proj.weight", (EI, H), True),
                        (p + f"mlp.{e}.down_proj.weight", (H, EI), True)]
    lay += [("model.norm.weight", (H,), False), ("lm_head.weight", (V, H), False)]
    for name, shape, q in lay:
        if not q:
            t[name] = plain(name, shape, originals)
            continue
        w = f64(bf16(randw(shape)))
        originals[name] = w
        codes, s = fp8_block_quant(w, ue8m0=ue8m0)
        t[name] = T("F8_E4M3", codes)
        t[name + "_scale_inv"] = T("F32", s)
    t["model.layers.1.mlp.gate.e_score_correction_bias"] = T("F32", RNG.standard_normal(E) * 0.01)
    originals["model.layers.1.mlp.gate.e_score_correction_bias"] = f64(t["model.layers.1.mlp.gate.e_score_correction_bias"])
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
          "weight_block_size": [128, 128]}
    if ue8m0:
        qc["scale_fmt"] = "ue8m0"
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
           "intermediate_size": I, "moe_intermediate_size": EI, "n_routed_experts": E,
           "n_shared_experts": 1, "first_k_dense_replace": 1, "num_hidden_layers": 2,
           "q_lora_rank": QL, "kv_lora_rank": KVL, "qk_rope_head_dim": 32, "vocab_size": V,
           "torch_dtype": "bfloat16", "quantization_config": qc}
    return t, cfg, None, originals


def ct_config(groups: dict, fmt: str, ignore=("lm_head",), kv=None):
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": groups, "ignore": list(ignore), "kv_cache_scheme": kv,
            "global_compression_ratio": None, "version": "0.12.2", "sparsity_config": {},
            "transform_config": {}}


def make_ct_fp8(strategy: str):
    """compressed-tensors float-quantized FP8: weight (F8_E4M3) + weight_scale (model dtype)."""
    H, I, KV, V, L = 256, 384, 64, 96, 2
    originals, t = {}, {}
    lay = llama_layout(H, I, KV, V, L)
    for name, shape, q in lay:
        if not q or name.startswith("lm_head"):
            t[name] = plain(name, shape, originals)
            continue
        w = f64(bf16(randw(shape)))
        originals[name] = w
        m = name[: -len(".weight")]
        if strategy == "tensor":
            s = bf16(np.abs(w).max() / E4M3_MAX).reshape(1)           # [1], BF16
            codes = to_e4m3(w / f64(s)[0])
            t[m + ".input_scale"] = T("BF16", bf16([0.02 + 0.01 * RNG.random()]))
        elif strategy == "channel":
            s = bf16(np.abs(w).max(axis=1, keepdims=True) / E4M3_MAX)  # [out, 1], BF16
            codes = to_e4m3(w / f64(s))
        elif strategy == "block":
            out, inn = shape
            R, C = math.ceil(out / 128), inn // 128                   # rows may be ragged
            pad = np.zeros((R * 128, inn)); pad[:out] = w
            amax = np.abs(pad.reshape(R, 128, C, 128)).max(axis=(1, 3))
            s = bf16(amax / E4M3_MAX)                                   # [ceil(out/128), in/128]
            full = np.repeat(np.repeat(f64(s), 128, 0), 128, 1)[:out]
            codes = to_e4m3(w / full)
        t[name] = T("F8_E4M3", codes)
        t[m + ".weight_scale"] = T("BF16", s)
    W = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
         "group_size": None, "block_structure": [128, 128] if strategy == "block" else None,
         "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    if strategy == "tensor":
        A = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor",
             "observer": "minmax"}
        kv = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
        for l in range(L):  # KV-cache scales live on the attention module
            t[f"model.layers.{l}.self_attn.k_scale"] = T("BF16", bf16([0.05 + 0.01 * l]))
            t[f"model.layers.{l}.self_attn.v_scale"] = T("BF16", bf16([0.03 + 0.01 * l]))
    elif strategy == "channel":
        A, kv = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}, None
    else:
        A, kv = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group",
                 "group_size": 128}, None
    groups = {"group_0": {"targets": ["Linear"], "weights": W, "input_activations": A,
                          "output_activations": None, "format": "float-quantized"}}
    cfg = base_config(H, I, KV, V, L)
    cfg["quantization_config"] = ct_config(groups, "float-quantized", kv=kv)
    return t, cfg, None, originals


def nvfp4_ct_quant(w, gs):
    """compressed-tensors NVFP4: scale_g = e4m3(gs*amax_g/6); codes = fp4(w*gs/scale_g)."""
    out, inn = w.shape
    g = w.reshape(out, inn // 16, 16)
    amax = np.abs(g).max(axis=2)
    s = to_e4m3(np.float64(gs) * amax / E2M1_MAX)
    sf = f64(s)
    sf = np.where(sf == 0, 0.125, sf)  # CT replaces zero FP8 scales by eps=0.125
    s = to_e4m3(sf)
    codes = fp4_codes(g * np.float64(gs) / sf[..., None]).reshape(out, inn)
    return pack_nibbles(codes), s


def make_ct_nvfp4():
    H, I, KV, V, L = 256, 512, 64, 96, 2
    originals, t = {}, {}
    lay = llama_layout(H, I, KV, V, L)
    W = {}
    for name, shape, q in lay:
        if not q or name.startswith("lm_head"):
            t[name] = plain(name, shape, originals)
        else:
            W[name[:-7]] = f64(bf16(randw(shape)))
    for grp in fused_groups(list(W)):
        # per-tensor gs = 448*6/amax (F32); fused q/k/v and gate/up share the MIN (llm-compressor)
        gs = min(float(f32(E4M3_MAX * E2M1_MAX / np.abs(W[m]).max())) for m in grp)
        gs = f32(gs)
        for m in grp:
            originals[m + ".weight"] = W[m]
            packed, s = nvfp4_ct_quant(W[m], gs)
            t[m + ".weight_packed"] = T("U8", packed)
            t[m + ".weight_scale"] = T("F8_E4M3", s)
            t[m + ".weight_global_scale"] = T("F32", gs.reshape(1))
            t[m + ".input_global_scale"] = T("F32", f32([E4M3_MAX * E2M1_MAX / 3.0]))
    WQ = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor_group",
          "group_size": 16, "observer": "minmax"}
    AQ = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": "local", "strategy": "tensor_group",
          "group_size": 16, "observer": "static_minmax"}
    groups = {"group_0": {"targets": ["Linear"], "weights": WQ, "input_activations": AQ,
                          "output_activations": None, "format": "nvfp4-pack-quantized"}}
    cfg = base_config(H, I, KV, V, L)
    cfg["quantization_config"] = ct_config(groups, "nvfp4-pack-quantized")
    return t, cfg, None, originals


def mx_scale_bytes(amax):
    """OCP MX scale: shared exponent = floor(log2(amax)) - emax(E2M1)=2, biased by 127."""
    e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127)
    return np.clip(e + 127, 0, 254).astype(np.uint8)


def mxfp4_quant_lastaxis(w):
    """(..., K) -> codes (..., K) uint8, scale bytes (..., K/32)."""
    g = w.reshape(w.shape[:-1] + (w.shape[-1] // 32, 32))
    sb = mx_scale_bytes(np.abs(g).max(axis=-1))
    codes = fp4_codes(g / e8m0_value(sb)[..., None])  # values above 6 saturate to 6
    return codes.reshape(w.shape), sb


def make_ct_mxfp4():
    H, I, KV, V, L = 256, 512, 64, 96, 2
    originals, t = {}, {}
    for name, shape, q in llama_layout(H, I, KV, V, L):
        if not q or name.startswith("lm_head"):
            t[name] = plain(name, shape, originals)
            continue
        w = f64(bf16(randw(shape)))
        originals[name] = w
        codes, sb = mxfp4_quant_lastaxis(w)
        m = name[:-7]
        t[m + ".weight_packed"] = T("U8", pack_nibbles(codes))
        t[m + ".weight_scale"] = T("U8", sb)
    WQ = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False, "strategy": "group",
          "group_size": 32, "scale_dtype": "torch.uint8"}
    groups = {"group_0": {"targets": ["Linear"], "weights": WQ, "input_activations": None,
                          "output_activations": None, "format": "mxfp4-pack-quantized"}}
    cfg = base_config(H, I, KV, V, L)
    cfg["quantization_config"] = ct_config(groups, "mxfp4-pack-quantized")
    return t, cfg, None, originals


def pack_int32(q: np.ndarray, bits: int, packed_dim=1) -> np.ndarray:
    """compressed-tensors pack-quantized: q (signed, [-2^(b-1), 2^(b-1)-1]) + 2^(b-1) -> unsigned,
    element i of a row at bit position i*bits (LSB first) of the row's int32 stream."""
    u = (q.astype(np.int64) + (1 << (bits - 1))).astype(np.uint64)
    if packed_dim == 0:
        u = u.T
    rows, cols = u.shape
    nwords = math.ceil(cols * bits / 32)
    out = np.zeros((rows, nwords + 1), np.uint64)
    for i in range(cols):
        pos = i * bits
        wi, bo = pos // 32, pos % 32
        out[:, wi] |= (u[:, i] << np.uint64(bo)) & np.uint64(0xFFFFFFFF)
        if bo + bits > 32:
            out[:, wi + 1] |= u[:, i] >> np.uint64(32 - bo)
    out = out[:, :nwords].astype(np.uint32).view(np.int32)
    return out.T.copy() if packed_dim == 0 else out


def unpack_int32(p: np.ndarray, bits: int, n: int, packed_dim=1) -> np.ndarray:
    if packed_dim == 0:
        p = p.T
    u = p.view(np.uint32).astype(np.uint64)
    rows = u.shape[0]
    u = np.concatenate([u, np.zeros((rows, 1), np.uint64)], axis=1)
    out = np.empty((rows, n), np.int64)
    mask = np.uint64((1 << bits) - 1)
    for i in range(n):
        pos = i * bits
        wi, bo = pos // 32, pos % 32
        v = u[:, wi] >> np.uint64(bo)
        if bo + bits > 32:
            v |= u[:, wi + 1] << np.uint64(32 - bo)
        out[:, i] = (v & mask).astype(np.int64)
    out -= 1 << (bits - 1)
    return out.T.copy() if packed_dim == 0 else out


def make_ct_w4a16_asym(G=32):
    """compressed-tensors pack-quantized INT4, group 32, asymmetric (packed zero points)."""
    H, I, KV, V, L = 256, 512, 64, 96, 2
    originals, t = {}, {}
    for name, shape, q in llama_layout(H, I, KV, V, L):
        if not q or name.startswith("lm_head"):
            t[name] = plain(name, shape, originals)
            continue
        w = f64(bf16(randw(shape)))
        originals[name] = w
        out, inn = shape
        g = w.reshape(out, inn // G, G)
        mn, mx = np.minimum(g.min(2), 0), np.maximum(g.max(2), 0)
        s = bf16((mx - mn) / 15.0)
        sf = np.where(f64(s) == 0, 1.0, f64(s))
        zp = np.clip(np.round(-8 - mn / sf), -8, 7)
        qv = np.clip(np.round(g / sf[..., None] + zp[..., None]), -8, 7).reshape(out, inn)
        m = name[:-7]
        t[m + ".weight_packed"] = T("I32", pack_int32(qv, 4))
        t[m + ".weight_shape"] = T("I64", np.array(shape, np.int64))
        t[m + ".weight_scale"] = T("BF16", s)
        t[m + ".weight_zero_point"] = T("I32", pack_int32(zp, 4, packed_dim=0))
    WQ = {"num_bits": 4, "type": "int", "symmetric": False, "dynamic": False, "strategy": "group",
          "group_size": G, "actorder": None, "observer": "minmax"}
    groups = {"group_0": {"targets": ["Linear"], "weights": WQ, "input_activations": None,
                          "output_activations": None, "format": "pack-quantized"}}
    cfg = base_config(H, I, KV, V, L)
    cfg["quantization_config"] = ct_config(groups, "pack-quantized")
    return t, cfg, None, originals


def modelopt_configs(algo, kv="FP8", group_size=None):
    q = {"quant_algo": algo, "kv_cache_quant_algo": kv, "exclude_modules": ["lm_head"]}
    if group_size:
        q["group_size"] = group_size
    hqc = {"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": q}
    if algo == "FP8":
        grp = {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
               "weights": {"dynamic": False, "num_bits": 8, "type": "float"}, "targets": ["Linear"]}
    else:
        grp = {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size},
               "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size},
               "targets": ["Linear"]}
    embedded = {"config_groups": {"group_0": grp}, "ignore": ["lm_head"], "quant_algo": algo,
                "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
                "producer": hqc["producer"], "quant_method": "modelopt"}
    return hqc, embedded


def make_modelopt_fp8():
    H, I, KV, V, L = 256, 512, 64, 96, 2
    originals, t, W = {}, {}, {}
    for name, shape, q in llama_layout(H, I, KV, V, L):
        if not q or name.startswith("lm_head"):
            t[name] = plain(name, shape, originals)
        else:
            W[name[:-7]] = f64(bf16(randw(shape)))
    for grp in fused_groups(list(W)):
        # ModelOpt unifies the per-tensor weight amax (and input amax) over a fused group
        s = f32(max(np.abs(W[m]).max() for m in grp) / E4M3_MAX)
        a = f32(0.01 + 0.01 * RNG.random())
        for m in grp:
            originals[m + ".weight"] = W[m]
            t[m + ".weight"] = T("F8_E4M3", to_e4m3(W[m] / np.float64(s)))
            t[m + ".weight_scale"] = T("F32", s.reshape(()))
            t[m + ".input_scale"] = T("F32", a.reshape(()))
    for l in range(L):
        t[f"model.layers.{l}.self_attn.k_proj.k_scale"] = T("F32", f32(1.0).reshape(()))
        t[f"model.layers.{l}.self_attn.v_proj.v_scale"] = T("F32", f32(1.0).reshape(()))
    hqc, emb = modelopt_configs("FP8")
    cfg = base_config(H, I, KV, V, L)
    cfg["quantization_config"] = emb
    return t, cfg, hqc, originals


def make_modelopt_nvfp4():
    H, I, KV, V, L = 256, 512, 64, 96, 2
    originals, t, W = {}, {}, {}
    for name, shape, q in llama_layout(H, I, KV, V, L):
        if not q or name.startswith("lm_head"):
            t[name] = plain(name, shape, originals)
        else:
            W[name[:-7]] = f64(bf16(randw(shape)))
    for grp in fused_groups(list(W)):
        ws2 = f32(max(np.abs(W[m]).max() for m in grp) / (E2M1_MAX * E4M3_MAX))  # unified
        inp = f32(0.5 / (E2M1_MAX * E4M3_MAX))
        for m in grp:
            w = W[m]
            originals[m + ".weight"] = w
            out, inn = w.shape
            g = w.reshape(out, inn // 16, 16)
            ws = np.abs(g).max(2) / (E2M1_MAX * np.float64(ws2))
            ws = np.where(ws == 0, 1.0, ws)
            ws = to_e4m3(np.clip(ws, 2.0 ** -9, E4M3_MAX))
            codes = fp4_codes(g / (f64(ws)[..., None] * np.float64(ws2))).reshape(out, inn)
            t[m + ".weight"] = T("U8", pack_nibbles(codes))
            t[m + ".weight_scale"] = T("F8_E4M3", ws)
            t[m + ".weight_scale_2"] = T("F32", ws2.reshape(()))
            t[m + ".input_scale"] = T("F32", inp.reshape(()))
    for l in range(L):
        t[f"model.layers.{l}.self_attn.k_proj.k_scale"] = T("F32", f32(1.0).reshape(()))
        t[f"model.layers.{l}.self_attn.v_proj.v_scale"] = T("F32", f32(1.0).reshape(()))
    hqc, emb = modelopt_configs("NVFP4", group_size=16)
    cfg = base_config(H, I, KV, V, L)
    cfg["quantization_config"] = emb
    return t, cfg, hqc, originals


def make_gptoss_mxfp4():
    """gpt-oss (HF layout): experts.{gate_up,down}_proj_{blocks,scales} U8, quant_method mxfp4."""
    H, I, E, V, L, NH, NKV, HD = 128, 96, 4, 96, 2, 4, 1, 32
    originals, t = {}, {}
    t["model.embed_tokens.weight"] = plain("model.embed_tokens.weight", (V, H), originals)
    for l in range(L):
        p = f"model.layers.{l}."
        for n, shp in [("input_layernorm.weight", (H,)), ("post_attention_layernorm.weight", (H,)),
                       ("self_attn.q_proj.weight", (NH * HD, H)), ("self_attn.q_proj.bias", (NH * HD,)),
                       ("self_attn.k_proj.weight", (NKV * HD, H)), ("self_attn.k_proj.bias", (NKV * HD,)),
                       ("self_attn.v_proj.weight", (NKV * HD, H)), ("self_attn.v_proj.bias", (NKV * HD,)),
                       ("self_attn.o_proj.weight", (H, NH * HD)), ("self_attn.o_proj.bias", (H,)),
                       ("self_attn.sinks", (NH,)), ("mlp.router.weight", (E, H)), ("mlp.router.bias", (E,)),
                       ("mlp.experts.gate_up_proj_bias", (E, 2 * I)), ("mlp.experts.down_proj_bias", (E, H))]:
            t[p + n] = plain(p + n, shp, originals)
        # stored orientation: [E, out_rows, in] with the MX groups along the LAST (input) axis.
        # gate_up rows interleave gate (even) / up (odd); the HF parameter is its transpose(1,2).
        for proj, rows, cols in [("gate_up_proj", 2 * I, H), ("down_proj", H, I)]:
            w = f64(bf16(randw((E, rows, cols))))
            originals[p + "mlp.experts." + proj] = w
            codes, sb = mxfp4_quant_lastaxis(w)
            blocks = pack_nibbles(codes).reshape(E, rows, cols // 32, 16)
            t[p + f"mlp.experts.{proj}_blocks"] = T("U8", blocks)
            t[p + f"mlp.experts.{proj}_scales"] = T("U8", sb)
    t["model.norm.weight"] = plain("model.norm.weight", (H,), originals)
    t["lm_head.weight"] = plain("lm_head.weight", (V, H), originals)
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": H,
           "intermediate_size": I, "num_local_experts": E, "num_experts_per_tok": 2,
           "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": NKV,
           "head_dim": HD, "vocab_size": V, "swiglu_limit": 7.0, "torch_dtype": "bfloat16",
           "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                              "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"],
                                   "quant_method": "mxfp4"}}
    return t, cfg, None, originals


def make_dtype_zoo():
    """No quantization config: bare tensors in every 8-bit float dtype safetensors knows."""
    originals, t = {}, {}
    x = RNG.standard_normal((16, 32)) * 0.5
    for dt, npdt in [("F8_E4M3", mld.float8_e4m3fn), ("F8_E5M2", mld.float8_e5m2),
                     ("F8_E4M3FNUZ", mld.float8_e4m3fnuz), ("F8_E5M2FNUZ", mld.float8_e5m2fnuz)]:
        name = f"model.zoo.{dt.lower()}.weight"
        t[name] = T(dt, x.astype(npdt))
        originals[name] = f64(t[name])
    e = np.array([[120, 127, 128, 130], [100, 127, 140, 0]], np.uint8)
    t["model.zoo.f8_e8m0.weight"] = T("F8_E8M0", e.view(mld.float8_e8m0fnu))
    originals["model.zoo.f8_e8m0.weight"] = e8m0_value(e)
    return t, {"architectures": ["Zoo"], "model_type": "zoo"}, None, originals


CONVENTIONS = {
    "deepseek_fp8_block": lambda: make_deepseek_fp8(False),
    "deepseek_fp8_block_ue8m0": lambda: make_deepseek_fp8(True),
    "ct_fp8_tensor": lambda: make_ct_fp8("tensor"),
    "ct_fp8_channel": lambda: make_ct_fp8("channel"),
    "ct_fp8_block": lambda: make_ct_fp8("block"),
    "ct_nvfp4": make_ct_nvfp4,
    "ct_mxfp4": make_ct_mxfp4,
    "ct_w4a16_asym_packed": make_ct_w4a16_asym,
    "modelopt_fp8": make_modelopt_fp8,
    "modelopt_nvfp4": make_modelopt_nvfp4,
    "gptoss_mxfp4": make_gptoss_mxfp4,
    "dtype_zoo": make_dtype_zoo,
}

# --------------------------------------------------------------------------------------
# detection + float64 reference dequantization (reads only what is on disk)
# --------------------------------------------------------------------------------------

ACT_SUFFIXES = (".input_scale", ".input_global_scale", ".input_zero_point", ".output_scale",
                ".output_zero_point", ".k_scale", ".v_scale", ".q_scale", ".prob_scale",
                ".k_zero_point", ".v_zero_point")


def detect(d: str) -> str:
    cfg = _load_json(os.path.join(d, "config.json"))
    qc = cfg.get("quantization_config") or {}
    hq = os.path.join(d, "hf_quant_config.json")
    if os.path.exists(hq):
        algo = _load_json(hq)["quantization"]["quant_algo"]
        return "modelopt:" + algo
    qm = str(qc.get("quant_method", "")).lower()
    if qm.startswith("modelopt"):
        return "modelopt:" + str(qc.get("quant_algo")).upper()
    if qm == "compressed-tensors":
        return "compressed-tensors"
    if qm == "fp8":
        return "fp8"
    if qm == "mxfp4":
        return "mxfp4"
    return "none"


def ct_group_args(qc: dict, module: str) -> dict:
    """Weights args of the (single) matching config group; targets here are all 'Linear'."""
    for g in qc["config_groups"].values():
        return g["weights"] | {"format": g.get("format", qc.get("format"))}
    raise KeyError(module)


def dequant_dir(d: str):
    """-> (real: name -> float64 array, roles: stored tensor name -> role, primary: real name -> stored name)."""
    tensors, where = load_dir(d)
    conv = detect(d)
    cfg = _load_json(os.path.join(d, "config.json"))
    qc = cfg.get("quantization_config") or {}
    real, roles, primary = {}, {}, {}
    names = set(tensors)

    def take(real_name, arr, prim, aux=()):
        real[real_name] = arr
        primary[real_name] = prim
        roles[prim] = "weight-codes"
        for a in aux:
            roles[a] = "weight-scale/aux"

    for n in sorted(names):
        if n.endswith(ACT_SUFFIXES):
            roles[n] = "activation/kv-scale (not a weight)"

    if conv == "fp8":
        bs = qc.get("weight_block_size")
        for n in sorted(names):
            if n.endswith(".weight") and tensors[n].dtype in ("F8_E4M3", "F8_E5M2"):
                s = n + "_scale_inv"
                x = f64(tensors[n])
                sc = f64(tensors[s])
                out, inn = x.shape
                bh, bw = bs if bs else (out, inn)
                full = np.repeat(np.repeat(sc.reshape(math.ceil(out / bh), math.ceil(inn / bw)), bh, 0),
                                 bw, 1)[:out, :inn]
                take(n, x * full, n, [s])  # weight_scale_inv MULTIPLIES
    elif conv == "compressed-tensors":
        for n in sorted(names):
            m, _, leaf = n.rpartition(".")
            if leaf not in ("weight", "weight_packed") or (m + ".weight_scale") not in names:
                continue
            a = ct_group_args(qc, m)
            fmt, strat = a["format"], a.get("strategy")
            sc = f64(tensors[m + ".weight_scale"])
            aux = [m + ".weight_scale"]
            if fmt in ("float-quantized", "naive-quantized", "int-quantized"):
                x = f64(tensors[n])
                out, inn = x.shape
                if strat == "block":
                    bh, bw = a["block_structure"]
                    full = np.repeat(np.repeat(sc, bh, 0), bw, 1)[:out, :inn]
                elif strat in ("group", "tensor_group"):
                    full = np.repeat(sc, a["group_size"], 1)[:, :inn]
                else:  # tensor: [1] or []; channel: [out, 1]
                    full = sc.reshape(-1, 1) if sc.size == out and strat == "channel" else sc.reshape(())
                take(n, x * full, n, aux)
            elif fmt == "nvfp4-pack-quantized":
                codes = unpack_nibbles(tensors[n].arr)
                gs = f64(tensors[m + ".weight_global_scale"]).reshape(())
                x = E2M1[codes] * np.repeat(sc, 16, 1) / gs  # global scale DIVIDES
                take(n[: -len("_packed")], x, n, aux + [m + ".weight_global_scale"])
            elif fmt == "mxfp4-pack-quantized":
                codes = unpack_nibbles(tensors[n].arr)
                x = E2M1[codes] * np.repeat(e8m0_value(tensors[m + ".weight_scale"].arr), 32, 1)
                take(n[: -len("_packed")], x, n, aux)
            elif fmt == "pack-quantized":
                bits = a["num_bits"]
                shape = tuple(int(v) for v in tensors[m + ".weight_shape"].arr)
                q = unpack_int32(tensors[n].arr, bits, shape[1]).astype(np.float64)
                G = a.get("group_size") or shape[1]
                zpn = m + ".weight_zero_point"
                zp = 0.0
                aux += [m + ".weight_shape"]
                if zpn in names:
                    zp = unpack_int32(tensors[zpn].arr, bits, shape[0], packed_dim=0).astype(np.float64)
                    zp = np.repeat(zp, G, 1)[:, : shape[1]]
                    aux.append(zpn)
                if strat == "channel":
                    full = sc.reshape(-1, 1)
                else:
                    full = np.repeat(sc, G, 1)[:, : shape[1]]
                take(n[: -len("_packed")], (q - zp) * full, n, aux)
    elif conv.startswith("modelopt:"):
        algo = conv.split(":")[1]
        for n in sorted(names):
            m, _, leaf = n.rpartition(".")
            if leaf != "weight" or (m + ".weight_scale") not in names:
                continue
            ws = f64(tensors[m + ".weight_scale"])
            if algo == "FP8":
                take(n, f64(tensors[n]) * ws.reshape(()), n, [m + ".weight_scale"])
            elif algo == "NVFP4":
                codes = unpack_nibbles(tensors[n].arr)
                ws2 = f64(tensors[m + ".weight_scale_2"]).reshape(())
                x = E2M1[codes] * np.repeat(ws, 16, -1) * ws2  # both MULTIPLY
                take(n, x, n, [m + ".weight_scale", m + ".weight_scale_2"])
    elif conv == "mxfp4":
        for n in sorted(names):
            if n.endswith("_blocks"):
                base = n[: -len("_blocks")]
                b, s = tensors[n].arr, tensors[base + "_scales"].arr
                codes = unpack_nibbles(b)                       # [..., G, 32]
                x = E2M1[codes] * e8m0_value(s)[..., None]
                take(base, x.reshape(b.shape[:-2] + (b.shape[-2] * 32,)), n, [base + "_scales"])
    for n in sorted(names):
        if n not in roles:
            roles[n] = "plain parameter"
            real[n] = f64(tensors[n])
            primary[n] = n
    return real, roles, primary, where, conv


# --------------------------------------------------------------------------------------
# writing examples
# --------------------------------------------------------------------------------------


def is_primary_name(n: str) -> bool:
    return n.endswith((".weight", ".weight_packed", "_blocks", ".bias", ".sinks")) and \
        not n.endswith(("_scale", "_scale_2", "_scale_inv", "_scales", "_global_scale", "_zero_point", "_shape"))


def write_example(root: str, name: str, tensors, cfg, hqc, sharded: bool):
    d = os.path.join(root, name + ("_sharded" if sharded else ""))
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    _dump_json(cfg, os.path.join(d, "config.json"), indent=2)
    if hqc:
        _dump_json(hqc, os.path.join(d, "hf_quant_config.json"), indent=4)
    if not sharded:
        st_write(os.path.join(d, "model.safetensors"), tensors)
    else:
        f1, f2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        s1 = {k: v for k, v in tensors.items() if is_primary_name(k)}
        s2 = {k: v for k, v in tensors.items() if k not in s1}
        st_write(os.path.join(d, f1), s1)
        st_write(os.path.join(d, f2), s2)
        total = sum(v.arr.nbytes for v in tensors.values())
        wm = {k: (f1 if k in s1 else f2) for k in sorted(tensors)}
        _dump_json({"metadata": {"total_size": total}, "weight_map": wm},
                   os.path.join(d, "model.safetensors.index.json"), indent=2)
    return d


def summarize(d: str, originals: dict):
    real, roles, primary, where, conv = dequant_dir(d)
    per_tensor = {k: float(np.linalg.norm(v)) for k, v in real.items()}
    quantized = {k for k in real if roles.get(primary[k]) == "weight-codes"}
    per_file: dict[str, float] = {}
    for k, v in per_tensor.items():
        fn = where[primary[k]]
        per_file[fn] = per_file.get(fn, 0.0) + v * v
    glob = math.sqrt(sum(v * v for v in per_tensor.values()))
    qglob = math.sqrt(sum(per_tensor[k] ** 2 for k in quantized))
    # sanity: dequantized weight must be close to the original (catches multiply/divide mixups)
    worst = 0.0
    for k in quantized:
        o = originals[k]
        worst = max(worst, float(np.linalg.norm(real[k] - o) / max(np.linalg.norm(o), 1e-30)))
    exp = {"convention": conv, "global_norm": glob, "quantized_weights_norm": qglob,
           "per_file_norm": {k: math.sqrt(v) for k, v in sorted(per_file.items())},
           "real_weights": {k: {"norm": per_tensor[k], "shape": list(real[k].shape),
                                "stored_as": primary[k], "file": where[primary[k]],
                                "quantized": k in quantized} for k in sorted(real)},
           "stored_tensor_roles": dict(sorted(roles.items())),
           "max_rel_quantization_error_vs_original": worst}
    _dump_json(exp, os.path.join(d, "expected.json"), indent=1)
    return exp




def build(root: str, names: list[str] | None = None) -> dict[str, str]:
    """Write the examples (every convention, or ``names``) under ``root``; returns name -> folder."""
    global RNG
    RNG = np.random.default_rng(20240917)  # the same files whatever was built before
    os.makedirs(root, exist_ok=True)
    out = {}
    for name, make in CONVENTIONS.items():
        tensors, cfg, hqc, originals = make()
        if names is not None and name not in names:
            continue
        for sharded in (False, True):
            folder = write_example(root, name, tensors, cfg, hqc, sharded)
            summarize(folder, originals)
            out[name + ("_sharded" if sharded else "")] = folder
    return out


if __name__ == "__main__":
    import sys

    for name, folder in build(sys.argv[1] if len(sys.argv) > 1 else "quant_examples", sys.argv[2:] or None).items():
        print(f"{name}: {folder}")
