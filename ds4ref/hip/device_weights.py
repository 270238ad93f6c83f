"""Model weights in device memory, uploaded once.

Matrices (everything 2-D or 3-D read by a matvec, the embedding and the routed
experts) keep the encoding the GGUF file stores (F32, F16, BF16, Q8_0, Q2_K, Q4_K, IQ2_XXS, MXFP4), so the
kernels read exactly the bytes the file holds; weights not from a GGUF file go up
as f32. Vectors (norms, biases, HC scalars, sinks, compressor position biases) go
up as f32, already dequantised (exact). The routing hash table goes up as int32.

`random_flash` (bf16) and `random_policy` (a published file's type policy) build a
Flash-shaped model straight on the device for the benchmark: the large matrices are
filled by a kernel, never held on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..console import progress

from ..gguf.mtp import PREFIX as MTP_PREFIX
from ..gguf.tensors import is_int_tensor, layer_tensor_shapes, tensor_shapes
from .guards import check_fits_device, check_weight_types
from .buffers import view
from .layouts import BLOCK_QUANTS, QUANT_WTYPES, DeviceWeight, f32_to_bf16_bits, pack_qrows

WTYPE_CODE = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q2_k": 4, "q4_k": 5, "iq2_xxs": 6, "mxfp4": 7}
_GGML_TO_WTYPE = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q2_K": "q2_k", "Q4_K": "q4_k",
                  "IQ2_XXS": "iq2_xxs", "MXFP4": "mxfp4"}

# The MTP block on the device is a one-layer model (gguf.mtp.mtp_config): its block's tensors under
# layer 0's names and its own head mix and norm under the head's names, so HipBackend's layer and
# head builders run it unchanged; e_proj, h_proj, enorm and hnorm keep their mtp.0.* names, and the
# embedding and output projection are the main model's (shared, not uploaded again).
MTP_HEAD = {"output_hc_fn.weight": "hc_head_fn.weight", "output_hc_base.weight": "hc_head_base.weight",
            "output_hc_scale.weight": "hc_head_scale.weight", "output_norm.weight": "norm.weight"}
MTP_INPUT = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight")
MTP_BORROWED = ("token_embd.weight", "output.weight")


def mtp_device_names(mcfg) -> dict[str, str]:
    """Device name -> MTPWeights name (`mtp.0.*`), for every tensor of the MTP block."""
    out = {f"blk.0.{s}": MTP_PREFIX + s for s in layer_tensor_shapes(mcfg, 0)}
    out.update({dev: MTP_PREFIX + own for dev, own in MTP_HEAD.items()})
    out.update({MTP_PREFIX + s: MTP_PREFIX + s for s in MTP_INPUT})
    return out


@dataclass
class DeviceTensor:
    """A matrix or expert stack as stored: shape is the NumPy value shape."""
    buf: object
    wtype: str
    shape: tuple
    packed: bool = False  # layouts.pack_qrows' layout, read by the quantised products

    def as_matrix(self) -> DeviceWeight:
        rows = int(np.prod(self.shape[:-1]))
        return DeviceWeight(self.buf, self.wtype, rows, int(self.shape[-1]), self.packed)


def is_vector(name: str, shape) -> bool:
    """Tensors used elementwise (f32 on the device) rather than through a matvec."""
    return len(shape) == 1 or name.endswith("_ape.weight")


# matrices read a row at a time by token (the embedding, DSpark's Markov input table), never multiplied
GATHERED = ("token_embd.weight", "markov_w1.weight")


def takes_packed(name: str, wtype: str, quantised_products: bool) -> bool:
    """Whether a matrix goes up in layouts.pack_qrows' layout: the block-quantised ones the quantised
    products read (official numerics); GATHERED ones are read by rows, never multiplied."""
    return quantised_products and wtype in QUANT_WTYPES and not name.endswith(GATHERED)


class DeviceWeights:
    def __init__(self, rt, config):
        self.rt, self.config = rt, config
        self.mats: dict[str, DeviceTensor] = {}
        self.vecs: dict[str, object] = {}
        self.bytes = 0
        self.borrowed: set[str] = set()  # another DeviceWeights' matrices, freed by it
        self.joints: dict[tuple, object] = {}  # join(): the buffers that hold joined matrices

    # ---- access ------------------------------------------------------------------
    def mat(self, name: str) -> DeviceWeight:
        return self.mats[name].as_matrix()

    def tensor(self, name: str) -> DeviceTensor:
        return self.mats[name]

    def vec(self, name: str):
        return self.vecs[name]

    def free(self) -> None:
        for name, t in self.mats.items():
            if name not in self.borrowed:
                t.buf.free()  # a joined matrix's view frees nothing: its joint buffer goes below
        for b in [*self.vecs.values(), *self.joints.values()]:
            b.free()
        self.mats, self.vecs, self.joints = {}, {}, {}

    def join(self, names) -> bool:
        """Lay these matrices' rows end to end in one buffer (each name then a view of its part),
        so that matrices of one shape that read the same input run as one grouped launch
        (HipBackend._mv_joint). False, and nothing moved, when they differ in shape or encoding
        or are not this object's own."""
        ts = [self.mats.get(n) for n in names]
        if any(t is None or n in self.borrowed for n, t in zip(names, ts)):
            return False
        if len({(t.wtype, t.shape, t.packed, t.buf.nbytes) for t in ts}) != 1:
            return False
        if tuple(names) in self.joints:
            return True
        size = ts[0].buf.nbytes
        joint = self.rt.malloc(size * len(ts))
        for i, (n, t) in enumerate(zip(names, ts)):
            part = view(joint, i * size, size)
            self.rt.d2d(part, t.buf, size)
            t.buf.free()
            self.mats[n] = DeviceTensor(part, t.wtype, t.shape, t.packed)
        self.joints[tuple(names)] = joint
        return True

    def joint(self, names) -> DeviceWeight | None:
        """The joined matrices as one: rows of every name in order (None unless join(names))."""
        joint = self.joints.get(tuple(names))
        if joint is None:
            return None
        w = self.mat(names[0])
        return DeviceWeight(joint, w.wtype, w.rows * len(names), w.cols, w.packed)

    # ---- building ------------------------------------------------------------------
    def _put_vec(self, name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, np.int32 if is_int_tensor(name) else np.float32)
        self.vecs[name] = self.rt.upload(arr)
        self.bytes += arr.nbytes

    def _put_mat(self, name: str, data: np.ndarray, wtype: str, shape, packed: bool = False) -> None:
        data = np.ascontiguousarray(data)
        if packed:
            data = pack_qrows(wtype, data.reshape(int(np.prod(shape[:-1])), -1))
        self.mats[name] = DeviceTensor(self.rt.upload(data), wtype, tuple(shape), packed)
        self.bytes += data.nbytes

    @classmethod
    def from_weights(cls, rt, weights, quantised_products: bool = False) -> "DeviceWeights":
        """Upload a Weights object; GGUF-backed weights keep their stored encoding (block quants
        repacked for the quantised products when `quantised_products`)."""
        self = cls(rt, weights.config)
        stored = _stored_types(weights)
        if stored:
            check_weight_types(stored)
        shapes = tensor_shapes(weights.config)
        check_fits_device(rt, upload_bytes(shapes, stored), "the model's weights")
        for name, shape in progress(shapes.items(), "uploading weights", len(shapes), "tensor"):
            if is_int_tensor(name) or is_vector(name, shape):
                self._put_vec(name, weights.get(name))
                continue
            wtype = _GGML_TO_WTYPE.get(stored.get(name, ""), "f32")
            if wtype == "f32":
                self._put_mat(name, np.asarray(weights.get(name), np.float32), "f32", shape)
            else:
                self._put_mat(name, _raw(weights, name, wtype), wtype, shape,
                              takes_packed(name, wtype, quantised_products))
        rt.synchronize()
        return self

    @classmethod
    def from_mtp(cls, rt, mtp_weights, main: "DeviceWeights", quantised_products: bool = False) -> "DeviceWeights":
        """The MTP block's tensors (gguf.mtp.MTPWeights) under mtp_device_names."""
        return cls.from_draft(rt, mtp_weights, mtp_device_names(mtp_weights.config), main, quantised_products)

    @classmethod
    def from_draft(cls, rt, draft_weights, names, main: "DeviceWeights",
                   quantised_products: bool = False) -> "DeviceWeights":
        """A draft module's tensors (gguf.mtp.MTPWeights, gguf.dspark_file.DSparkWeights) under their
        device names (`names`: device name -> the module's name), each in its stored encoding as
        from_weights keeps the main model's; the embedding and output projection are `main`'s buffers."""
        self = cls(rt, draft_weights.config)
        stored = {dev: _draft_stored_type(draft_weights, ours) for dev, ours in names.items()}
        check_weight_types(stored)
        for dev, ours in names.items():
            shape = draft_weights.shape(ours)
            wtype = _GGML_TO_WTYPE.get(stored[dev], "f32")
            if is_vector(dev, shape):
                self._put_vec(dev, draft_weights.get(ours))
            elif wtype == "f32":
                self._put_mat(dev, np.asarray(draft_weights.get(ours), np.float32), "f32", shape)
            else:
                self._put_mat(dev, _draft_raw(draft_weights, ours, wtype), wtype, shape,
                              takes_packed(dev, wtype, quantised_products))
        self.borrow(main)
        rt.synchronize()
        return self

    def borrow(self, main: "DeviceWeights") -> None:
        """The main model's embedding and output projection, which a draft module shares."""
        for name in MTP_BORROWED:
            self.mats[name] = main.mats[name]
            self.borrowed.add(name)

    @classmethod
    def random_flash(cls, rt, config, seed: int = 0, big: int = 1 << 21) -> "DeviceWeights":
        """bf16 random weights for `config`; tensors over `big` elements are made by a kernel."""
        from ..gguf.tiny import _random_tensor
        self = cls(rt, config)
        init = rt.compile_file("step_ops.hip").kernel("step_init_bf16")
        for i, (name, shape) in enumerate(tensor_shapes(config).items()):
            suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
            n = int(np.prod(shape))
            if is_int_tensor(name) or is_vector(name, shape):
                rng = np.random.default_rng([seed, i])
                self._put_vec(name, _random_tensor(rng, config, suffix, tuple(shape)))
            elif n <= big:
                rng = np.random.default_rng([seed, i])
                self._put_mat(name, f32_to_bf16_bits(_random_tensor(rng, config, suffix, tuple(shape))),
                              "bf16", shape)
            else:
                buf = rt.malloc(2 * n)
                # uniform(-a, a) has std a/sqrt(3): match the host init's std gain/sqrt(K)
                std = 1.0 if suffix == "token_embd.weight" else _gain(suffix) / np.sqrt(shape[-1])
                rt.launch(init, (4096,), (256,), (buf, np.int64(n), np.uint64(seed * 1000003 + i),
                                                   np.float32(std * np.sqrt(3.0))))
                self.mats[name] = DeviceTensor(buf, "bf16", tuple(shape))
                self.bytes += 2 * n
        rt.synchronize()
        return self


    @classmethod
    def random_policy(cls, rt, config, policy: str = "q2", seed: int = 0, template_bytes: int = 8 << 20,
                      quantised_products: bool = False):
        """Random weights stored as a published file stores them (tiny.POLICIES for the
        routed experts, tiny_dtypes for the rest). The host makes one template of valid rows
        per (tensor kind, width), at most `template_bytes`, with the std the tiny model's init
        gives; each tensor is tiled from it on the device, row i taking a hashed template row
        (block quants in layouts.pack_qrows' layout when `quantised_products`)."""
        from ..gguf.tiny import tiny_dtypes
        self = cls(rt, config)
        dtypes = tiny_dtypes(config)
        tensors = [(name, name.split(".", 2)[-1] if name.startswith("blk.") else name, shape, dtypes.get(name, "f32"))
                   for name, shape in tensor_shapes(config).items()]
        self._tile_random(config, tensors, policy, seed, template_bytes, quantised_products)
        return self

    @classmethod
    def random_policy_mtp(cls, rt, main: "DeviceWeights", mcfg, policy: str = "q2", seed: int = 0,
                          template_bytes: int = 8 << 20, quantised_products: bool = False) -> "DeviceWeights":
        """A random MTP block beside random_policy's model (from_mtp's names; the embedding and the
        output projection are `main`'s): its layer in the policy's types as a main layer, e_proj
        and h_proj Q8_0 and the hc head F16, as gguf.tiny.random_mtp stores them."""
        from ..gguf.mtp import mtp_tensor_shapes
        extra = {"e_proj.weight": "q8_0", "h_proj.weight": "q8_0", "hc_head_fn.weight": "f16"}
        return cls.random_policy_draft(rt, main, mcfg, mtp_device_names(mcfg), mtp_tensor_shapes(mcfg), extra,
                                       policy, seed + 1, template_bytes, quantised_products)

    @classmethod
    def random_policy_draft(cls, rt, main: "DeviceWeights", config, names, shapes, own_types, policy: str = "q2",
                            seed: int = 0, template_bytes: int = 8 << 20,
                            quantised_products: bool = False) -> "DeviceWeights":
        """A random draft module beside random_policy's model, under `names` (device name -> the
        module's `mtp.S.*` name, whose shape `shapes` gives): its blocks' tensors in the policy's
        types as a main layer's, its own by `own_types` (by suffix after `mtp.S.`), the rest F32."""
        from ..gguf.tiny import _DTYPE_BY_SUFFIX
        self = cls(rt, config)
        tensors = []
        for dev, ours in names.items():
            suffix = ours.split(".", 2)[2]
            tensors.append((dev, suffix, shapes[ours], _DTYPE_BY_SUFFIX.get(suffix, own_types.get(suffix, "f32"))))
        self._tile_random(config, tensors, policy, seed, template_bytes, quantised_products)
        self.borrow(main)
        return self

    def _tile_random(self, config, tensors, policy: str, seed: int, template_bytes: int,
                     quantised_products: bool) -> None:
        """random_policy's making of (device name, tensor kind, shape, stored type) tensors."""
        from ..gguf.tiny import POLICIES, _EXPERTS, _random_tensor
        rt = self.rt
        tile = rt.compile_file("step_ops.hip").kernel("step_tile_rows")
        gate_up, down = POLICIES[policy]
        templates: dict[tuple, tuple] = {}
        for i, (name, suffix, shape, dtype) in enumerate(tensors):
            rng = np.random.default_rng([seed, i])
            if is_int_tensor(name) or is_vector(name, shape):
                self._put_vec(name, _random_tensor(rng, config, suffix, tuple(shape)))
                continue
            qtype = (down if suffix == "ffn_down_exps.weight" else gate_up) if suffix in _EXPERTS else dtype.upper()
            packed = takes_packed(name, _GGML_TO_WTYPE[qtype], quantised_products)
            key = (suffix, qtype, shape[-1], packed)
            if key not in templates:
                templates[key] = _template(rt, config, suffix, qtype, int(shape[-1]), template_bytes, seed, packed)
            tmpl, n_tmpl, row_bytes = templates[key]
            rows = int(np.prod(shape[:-1]))
            buf = rt.malloc(rows * row_bytes)
            rt.launch(tile, (8192,), (256,), (buf, np.int64(rows), np.int32(row_bytes // 4), tmpl,
                                               np.int32(n_tmpl), np.uint64(seed * 1000003 + i)))
            self.mats[name] = DeviceTensor(buf, _GGML_TO_WTYPE[qtype], tuple(shape), packed)
            self.bytes += rows * row_bytes
        rt.synchronize()
        for tmpl, _, _ in templates.values():
            tmpl.free()


def _template(rt, config, suffix: str, qtype: str, cols: int, max_bytes: int, seed: int, packed: bool = False):
    """(device buffer, rows, bytes per row) of valid `qtype` rows `cols` wide (pack_qrows' layout
    when `packed`)."""
    import gguf
    from ..gguf.file import encode_tensor
    from ..gguf.tiny import _random_tensor, random_blocks
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    row_bytes = cols // block * size
    rows = max(1, min(4096, max_bytes // row_bytes))
    rng = np.random.default_rng([seed, cols, len(suffix)])
    values = _random_tensor(rng, config, suffix, (rows, cols))
    if qtype in ("IQ2_XXS", "Q2_K", "Q4_K", "MXFP4"):
        data = random_blocks(rng, qtype, (rows, cols), float(values.std())).data
    else:
        data, _ = encode_tensor(suffix, values, qtype.lower())
    data = np.ascontiguousarray(data).view(np.uint8).reshape(rows, row_bytes)
    if packed:
        data = pack_qrows(qtype.lower(), data)
    if data.shape[1] % 4:  # step_tile_rows copies 32-bit words
        raise ValueError(f"{suffix}: {qtype} rows of {cols} are {data.shape[1]} bytes, not whole 32-bit words")
    return rt.upload(data), rows, data.shape[1]


def upload_bytes(shapes, stored: dict[str, str]) -> int:
    """Device bytes of the upload, from the shapes and stored types alone (nothing read yet)."""
    total = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        wtype = _GGML_TO_WTYPE.get(stored.get(name, ""), "f32")
        if wtype in BLOCK_QUANTS:
            nbytes, per = BLOCK_QUANTS[wtype]
            total += n // per * nbytes
        else:
            total += n * (2 if wtype in ("f16", "bf16") else 4)
    return total


def _gain(suffix: str) -> float:
    from ..gguf.tiny import _gain as tiny_gain
    return tiny_gain(suffix)


def _stored_types(weights) -> dict[str, str]:
    """GGML type name per tensor for GGUF-backed weights, else {}."""
    if not hasattr(weights, "qtype"):
        return {}
    out = {}
    for name in tensor_shapes(weights.config):
        out[name] = weights.qtype(name).name
    return out


def _half(w, name: str) -> int | None:
    """Which half of a fused [e_proj | h_proj] an MTPWeights tensor is (None: a tensor of its own)."""
    return w._split(name) if hasattr(w, "_split") else None


def _draft_source_name(w, name: str) -> str:
    """The source tensor a draft module's tensor is read from (a fused [e_proj | h_proj] for both halves)."""
    return w.fused if _half(w, name) is not None else w.names[name]


def _draft_stored_type(w, name: str) -> str:
    return w.source.tensor(_draft_source_name(w, name)).qtype.name


def _draft_raw(w, name: str, wtype: str) -> np.ndarray:
    """_raw for a draft module's tensor: its stored values/bytes, the half of a fused matrix it is."""
    half = _half(w, name)
    if wtype in QUANT_WTYPES:
        _qtype, blocks = w._stored_blocks(name)  # splits a fused matrix by whole blocks
        return np.asarray(blocks).view(np.uint8)
    data = np.asarray(w.source.tensor(_draft_source_name(w, name)).data)
    if half is not None:
        d = w.config.n_embd
        data = data[:, half * d:(half + 1) * d]
    if wtype == "bf16":
        return data.view(np.uint16) if data.dtype != np.uint16 else data
    return data.astype(np.float16, copy=False)


def _raw(weights, name: str, wtype: str) -> np.ndarray:
    """The file's stored values/bytes of a matrix: f16 values, bf16 bits, the row bytes of a block quant."""
    data = np.asarray(weights.file.tensor(name).data)
    if wtype == "bf16":
        return data.view(np.uint16) if data.dtype != np.uint16 else data
    if wtype == "f16":
        return data.astype(np.float16, copy=False)
    return data.view(np.uint8)
