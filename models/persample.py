"""Per-sample gradients by hand-written formulas, as a torch module that exports to ONNX.

``torch.func`` vmap(grad) does not export with torch 2.13, so the backward pass is written
out layer by layer for the supported set, with the weights as graph inputs:

* Linear: the per-sample gradient is the outer product d_i a_i^T, never materialised;
  its squared norm is ||d_i||^2 ||a_i||^2 (ghost norm) and the clipped sum is
  (s * d)^T a with s_i the clip factor.
* Conv2d (stride 1, no padding): im2col by kw then kh slices, or by one depthwise Conv
  with one-hot kernels where that is faster (exact either way; see ``_unfold``; not
  ``F.unfold``, which becomes slow Gather ops in onnxruntime, nor kh*kw slices) and a
  batched MatMul give the per-sample weight gradient [B, out, in*k*k], small for the
  zoo's convs; the input gradient is a transposed conv.
* Conv2d with stride, zero padding or dilation, and Conv1d (as a Conv2d of height 1): the
  same im2col, strided and dilated, of the zero-padded input; the input gradient is a
  transposed conv with those settings and the output padding that restores the input size.
  Stride-1 unpadded Conv2d keeps the code above, so the zoo's graphs do not change.
* Grouped convs (groups G; depthwise when G = in_channels): the columns split into G blocks
  of (C/G)*kh*kw rows, one batched MatMul per block pair gives the per-sample weight
  gradient [B, out, (C/G)*kh*kw] (the weight's own layout); the input gradient is the
  transposed conv with the same groups.
* MaxPool2d 2x2: the four window elements by strided slices; the gradient goes to the
  first maximum in scan order, torch's tie rule.
* MaxPool2d/MaxPool1d of any kernel and stride (no padding, floor mode): the kh*kw window
  elements by strided slices, a one-hot "winner" mask per element (first maximum in scan
  order); the input gradient is one transposed conv of the kh*kw masked output gradients
  with one-hot kernels, which adds overlapping windows' shares. The 2x2 stride-2 pool on even
  sizes keeps the code above, so the zoo's graphs do not change.
* AvgPool2d/AvgPool1d (no padding): the output gradient spread evenly over each window, a
  transposed conv of the per-channel map with a constant 1/(kh*kw) kernel; GlobalAvgPool:
  the output gradient / (number of positions), broadcast.
* LayerNorm / GroupNorm (affine): statistics per sample, so the per-sample weight and bias
  gradients are sums of d * xhat and d over the positions sharing a parameter; the input
  gradient is rstd * (g - mean(g) - xhat * mean(g * xhat)) per normalisation group, with
  g = d * weight. BatchNorm is refused (edge_sdk.model.BATCHNORM_REASON).
* Relu: gradient where the pre-activation is > 0 (torch's rule at 0).
* Embedding (first layer, int64 ids [B, L]): rows gathered from the table; the per-sample
  table gradient [B, V, D] is one_hot(ids)^T @ d (a repeated id adds its positions), its
  clipped sum one MatMul of the scaled d with the one-hot ids.
* Tanh, Sigmoid, GELU (erf or tanh form), LeakyReLU, Hardswish: the upstream gradient times
  f'(pre-activation), f' written out as torch's autograd computes it (see ``activation``).
* Graphs (``ModelSpec.inputs``): Add passes its gradient unchanged to each input, Concat
  splits it by channels; a node read by several layers adds what they send back; gradients
  are only carried to nodes with parameters upstream (a chain: nothing below its first
  parameterised layer, as before, so chains trace to the same graphs).

Outputs: per-sample L2 norms [B] of the full gradient, per-sample losses [B], then the
sum over the batch of the clipped per-sample gradients, one output per parameter.

The masked variant (``masked=True``) takes one 0/1 mask per parameter after the weights
and restricts everything to the kept coordinates (Fed-SPA's rand-k set omega): norms of
the masked per-sample gradients (for a Linear layer sum_oi M_oi d_o^2 a_i^2, one MatMul
(d*d) @ M), clipping on those norms, and the masked clipped sum.
Clip factor: min(1, C / max(norm, tiny)), so zero gradients stay zero and C = inf
disables clipping.

The plain variant (``plain=True``) returns per-sample losses and the batch's unclipped
summed gradient, without norms, for the device-level mode (each device clips its whole
update, issue 16).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_sdk.model import (
    ACTIVATIONS,
    Add,
    AvgPool1d,
    AvgPool2d,
    Concat,
    Conv1d,
    Conv2d,
    Embedding,
    Flatten,
    Gelu,
    GlobalAvgPool,
    GroupNorm,
    Hardswish,
    LayerNorm,
    LeakyRelu,
    Linear,
    MaxPool1d,
    MaxPool2d,
    ModelSpec,
    Relu,
    Sigmoid,
    Tanh,
    conv_geometry,
    pool_geometry,
)

_TINY = float(torch.finfo(torch.float32).tiny)


_ROW_MIN = 8  # output row width from which the slices beat the one-hot Conv (measured)


def _unfold(x: Tensor, kh: int, kw: int, stride: tuple[int, int] = (1, 1),
            dilation: tuple[int, int] = (1, 1)) -> Tensor:
    """[B, C, H, W] -> [B, C*kh*kw, Ho, Wo], the im2col patches, channel order (c, i, j).

    Both ways below only copy (or multiply by 1.0 and add exact zeros), so the columns are
    exactly the input's values; which is faster in onnxruntime depends on the shape. Thread
    CPU time, 1 thread, batch 32, against the one-hot Conv (issue 18): 5x5 on 1x28x28
    678 -> 455 us, on 10x12x12 995 -> 759 us, 1x1 120 -> 40 us, 1x3 on 16x66 204 -> 116
    us; but 3x3 on 32x27x7 (rows of 5) 2,360 -> 3,612 us and stride 2 86 -> 212 us.

    * stride 1 with output rows of at least ``_ROW_MIN`` (or a 1x1 kernel): two stages of
      slices, the kw column shifts stacked ([B, C, kw, H, Wo]), then the kh row shifts of
      that ([B, C, kh, kw, Ho, Wo]);
    * otherwise one depthwise Conv whose kernels are one-hot (one output channel per
      window position), one MLAS Conv in place of kh*kw Slice, Unsqueeze and Concat nodes.
    """
    (sh, sw), (dh, dw) = stride, dilation
    h, w = x.shape[2], x.shape[3]
    ho, wo = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    if (sh, sw) != (1, 1) or (wo < _ROW_MIN and kh * kw > 1):
        c = x.shape[1]
        eye = torch.eye(kh * kw, dtype=x.dtype).reshape(kh * kw, 1, kh, kw).repeat(c, 1, 1, 1)
        return F.conv2d(x, eye, stride=stride, dilation=dilation, groups=c)
    cols = torch.stack([x[:, :, :, j * dw : j * dw + wo] for j in range(kw)], dim=2)
    if kh > 1:  # B, C, kw, H, Wo -> B, C, kh, kw, Ho, Wo
        cols = torch.stack([cols[:, :, :, i * dh : i * dh + ho, :] for i in range(kh)], dim=2)
    return cols.reshape(x.shape[0], -1, ho, wo)


def im2col(x: Tensor, k: int) -> Tensor:
    """[B, C, H, W] -> [B, C*k*k, Ho*Wo] for a k x k kernel, stride 1, column order (c, i, j)."""
    c, h, w = x.shape[1], x.shape[2], x.shape[3]
    ho, wo = h - k + 1, w - k + 1
    return _unfold(x, k, k).reshape(-1, c * k * k, ho * wo)


def _plain(layer: Any) -> bool:
    """A stride-1, unpadded, undilated Conv2d: the zoo's conv, with its own (older) code."""
    return (isinstance(layer, Conv2d) and layer.stride == 1 and layer.padding == 0
            and layer.dilation == 1 and layer.groups == 1)


def conv_cols(x: Tensor, layer: Conv2d | Conv1d) -> tuple[Tensor, int, int]:
    """im2col of a conv seen as 2-D: x [B, C, H, W] (Conv1d: H = 1) -> ([B, C*kh*kw, Ho*Wo],
    Ho, Wo), column order (c, i, j) as in the weight's reshape; slices, not F.unfold."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = conv_geometry(layer)
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    c, h, w = x.shape[1], x.shape[2], x.shape[3]
    ho, wo = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    cols = _unfold(x, kh, kw, stride=(sh, sw), dilation=(dh, dw))
    return cols.reshape(-1, c * kh * kw, ho * wo), ho, wo


def conv_input_grad(d: Tensor, w: Tensor, layer: Conv2d | Conv1d,
                    in_shape: tuple[int, ...]) -> Tensor:
    """Gradient w.r.t. the conv's input [B, *in_shape] from the output gradient ``d``."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = conv_geometry(layer)
    if isinstance(layer, Conv1d):
        length, lo = in_shape[1], d.shape[2]
        pad_out = length + 2 * pw - dw * (kw - 1) - 1 - (lo - 1) * sw
        return F.conv_transpose1d(d, w, stride=sw, padding=pw, output_padding=pad_out,
                                  groups=layer.groups, dilation=dw)
    h, wd, ho, wo = in_shape[1], in_shape[2], d.shape[2], d.shape[3]
    pad_out = (h + 2 * ph - dh * (kh - 1) - 1 - (ho - 1) * sh,
               wd + 2 * pw - dw * (kw - 1) - 1 - (wo - 1) * sw)
    return F.conv_transpose2d(d, w, stride=(sh, sw), padding=(ph, pw), output_padding=pad_out,
                              groups=layer.groups, dilation=(dh, dw))


def conv_apply(w: Tensor, cols: Tensor, groups: int) -> Tensor:
    """Conv output [B, out, Ho*Wo] from im2col columns [B, C*kh*kw, Ho*Wo]: one MatMul, or
    one per channel group (a batched MatMul over the groups)."""
    out_channels = w.shape[0]
    if groups == 1:
        return torch.matmul(w.reshape(out_channels, -1), cols)
    cg = cols.reshape(cols.shape[0], groups, -1, cols.shape[2])
    wg = w.reshape(groups, out_channels // groups, -1)
    return torch.matmul(wg, cg).reshape(cols.shape[0], out_channels, cols.shape[2])


def conv_weight_grad(dflat: Tensor, cols: Tensor, groups: int) -> Tensor:
    """Per-sample weight gradients [B, out, (C/G)*kh*kw] from the output gradient
    [B, out, Ho*Wo] and the columns [B, C*kh*kw, Ho*Wo]; a group only sees its channels."""
    if groups == 1:
        return torch.matmul(dflat, cols.transpose(1, 2))
    b, out_channels, n = dflat.shape
    dg = dflat.reshape(b, groups, out_channels // groups, n)
    cg = cols.reshape(b, groups, -1, n)
    return torch.matmul(dg, cg.transpose(2, 3)).reshape(b, out_channels, -1)


def avg_pool(h: Tensor, layer: AvgPool2d | AvgPool1d) -> Tensor:
    if isinstance(layer, AvgPool1d):
        return F.avg_pool1d(h, layer.kernel, layer.stride)
    return F.avg_pool2d(h, layer.kernel, layer.stride)


def avg_unpool(d: Tensor, layer: AvgPool2d | AvgPool1d, in_shape: tuple[int, ...]) -> Tensor:
    """Input gradient [B, *in_shape] of an average pool from its output gradient ``d``."""
    (kh, kw), (sh, sw) = pool_geometry(layer)
    h, w = (1, in_shape[1]) if isinstance(layer, AvgPool1d) else in_shape[1:]
    ho, wo = (h - kh) // sh + 1, (w - kw) // sw + 1
    ones = torch.full((1, 1, kh, kw), 1.0 / (kh * kw), dtype=d.dtype)
    g = F.conv_transpose2d(d.reshape(-1, 1, ho, wo), ones, stride=(sh, sw),
                           output_padding=(h - kh - (ho - 1) * sh, w - kw - (wo - 1) * sw))
    return g.reshape(-1, *in_shape)


def norm_forward(h: Tensor, w: Tensor, b: Tensor,
                 layer: LayerNorm | GroupNorm) -> tuple[Tensor, dict[str, Any]]:
    """Output of a LayerNorm/GroupNorm and what its backward needs."""
    in_shape = tuple(h.shape[1:])
    if isinstance(layer, LayerNorm):
        group = math.prod(layer.normalized_shape)
        bshape: tuple[int, ...] = layer.normalized_shape
    else:
        group = math.prod(in_shape) // layer.num_groups
        bshape = (layer.num_channels, *([1] * (len(in_shape) - 1)))
    hg = h.reshape(-1, math.prod(in_shape) // group, group)
    xc = hg - hg.mean(dim=2, keepdim=True)
    rstd = torch.rsqrt((xc * xc).mean(dim=2, keepdim=True) + layer.eps)
    xhat = (xc * rstd).reshape(-1, *in_shape)
    out = xhat * w.reshape(bshape) + b.reshape(bshape)
    return out, {"xhat": xhat, "rstd": rstd, "w": w.reshape(bshape), "group": group,
                 "in_shape": in_shape}


def norm_backward(d: Tensor, c: dict[str, Any],
                  layer: LayerNorm | GroupNorm) -> tuple[Tensor, Tensor]:
    """Per-sample (weight, bias) gradients [B, *param shape] of a LayerNorm/GroupNorm."""
    xhat, rank = c["xhat"], len(c["in_shape"])
    if isinstance(layer, LayerNorm):
        axes = tuple(range(1, 1 + rank - len(layer.normalized_shape)))
    else:
        axes = tuple(range(2, 1 + rank))
    gw, gb = d * xhat, d
    if axes:
        gw, gb = gw.sum(dim=axes), gb.sum(dim=axes)
    return gw, gb


def norm_input_grad(d: Tensor, c: dict[str, Any]) -> Tensor:
    group = c["group"]
    g = (d * c["w"]).reshape(-1, math.prod(c["in_shape"]) // group, group)
    xg = c["xhat"].reshape(g.shape)
    dx = c["rstd"] * (g - g.mean(dim=2, keepdim=True)
                      - xg * (g * xg).mean(dim=2, keepdim=True))
    return dx.reshape(-1, *c["in_shape"])


def activation(layer: Any, h: Tensor) -> tuple[Tensor, Tensor]:
    """(f(h), f'(h)) of an element-wise activation other than Relu, torch's formulas
    (including its choice at the kinks: LeakyReLU slope at 0, Hardswish 0 at -3, 1 at 3)."""
    if isinstance(layer, Tanh):
        t = torch.tanh(h)
        return t, 1.0 - t * t
    if isinstance(layer, Sigmoid):
        s = torch.sigmoid(h)
        return s, s * (1.0 - s)
    if isinstance(layer, Gelu):
        if layer.approximate == "tanh":
            k = math.sqrt(2.0 / math.pi)
            inner = k * (h + 0.044715 * h * h * h)
            t = torch.tanh(inner)
            deriv = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * h * h)
            return 0.5 * h * (1.0 + t), deriv
        cdf = 0.5 * (1.0 + torch.erf(h * (1.0 / math.sqrt(2.0))))
        pdf = torch.exp(-0.5 * h * h) * (1.0 / math.sqrt(2.0 * math.pi))
        return h * cdf, cdf + h * pdf
    if isinstance(layer, LeakyRelu):
        pos = h > 0
        slope = layer.negative_slope
        return torch.where(pos, h, h * slope), torch.where(pos, 1.0, slope).to(h.dtype)
    if isinstance(layer, Hardswish):
        mid = h / 3.0 + 0.5
        deriv = torch.where(h <= -3.0, 0.0, torch.where(h < 3.0, mid, 1.0)).to(h.dtype)
        return h * torch.clamp(h + 3.0, 0.0, 6.0) / 6.0, deriv
    raise TypeError(f"not an activation: {layer!r}")


def _pool_masks(h: Tensor) -> tuple[Tensor, list[Tensor]]:
    a = [h[:, :, 0::2, 0::2], h[:, :, 0::2, 1::2], h[:, :, 1::2, 0::2], h[:, :, 1::2, 1::2]]
    m = torch.maximum(torch.maximum(a[0], a[1]), torch.maximum(a[2], a[3]))
    masks, taken = [], torch.zeros_like(m, dtype=torch.bool)
    for ai in a:
        hit = (ai == m) & ~taken
        masks.append(hit.to(h.dtype))
        taken = taken | hit
    return m, masks


def _unpool(g: Tensor, masks: list[Tensor]) -> Tensor:
    c, ho, wo = g.shape[1], g.shape[2], g.shape[3]
    g00, g01, g10, g11 = (g * mk for mk in masks)
    top = torch.stack([g00, g01], dim=-1).reshape(-1, c, ho, 2 * wo)
    bot = torch.stack([g10, g11], dim=-1).reshape(-1, c, ho, 2 * wo)
    return torch.stack([top, bot], dim=3).reshape(-1, c, 2 * ho, 2 * wo)


def _pair_pool(layer: Any, h: Tensor) -> bool:
    """The zoo's 2x2 stride-2 max pool on even sizes, with its own (older) code."""
    return (isinstance(layer, MaxPool2d) and layer.kernel == 2 and layer.stride == 2
            and h.shape[2] % 2 == 0 and h.shape[3] % 2 == 0)


def max_pool_forward(h: Tensor, layer: MaxPool2d | MaxPool1d) -> tuple[Tensor, dict[str, Any]]:
    """Max pool output and its backward cache: one winner mask per window element."""
    (kh, kw), (sh, sw) = pool_geometry(layer)
    h4 = h.unsqueeze(2) if isinstance(layer, MaxPool1d) else h
    hi, wi = h4.shape[2], h4.shape[3]
    ho, wo = (hi - kh) // sh + 1, (wi - kw) // sw + 1
    parts = [h4[:, :, i : i + (ho - 1) * sh + 1 : sh, j : j + (wo - 1) * sw + 1 : sw]
             for i in range(kh) for j in range(kw)]
    m = parts[0]
    for part in parts[1:]:
        m = torch.maximum(m, part)
    masks, taken = [], torch.zeros_like(m, dtype=torch.bool)
    for part in parts:  # first maximum in scan order wins, as in torch
        hit = (part == m) & ~taken
        masks.append(hit.to(h.dtype))
        taken = taken | hit
    out = m.squeeze(2) if isinstance(layer, MaxPool1d) else m
    return out, {"masks": masks, "hw": (hi, wi), "in_shape": tuple(h.shape[1:])}


def max_pool_input_grad(d: Tensor, c: dict[str, Any], layer: MaxPool2d | MaxPool1d) -> Tensor:
    """Input gradient: each window's gradient to its winner, overlapping windows added."""
    (kh, kw), (sh, sw) = pool_geometry(layer)
    d4 = d.unsqueeze(2) if isinstance(layer, MaxPool1d) else d
    ch, ho, wo = d4.shape[1], d4.shape[2], d4.shape[3]
    hi, wi = c["hw"]
    shares = torch.stack([d4 * mk for mk in c["masks"]], dim=2).reshape(-1, kh * kw, ho, wo)
    onehot = torch.eye(kh * kw, dtype=d.dtype).reshape(kh * kw, 1, kh, kw)
    g = F.conv_transpose2d(shares, onehot, stride=(sh, sw),
                           output_padding=(hi - kh - (ho - 1) * sh, wi - kw - (wo - 1) * sw))
    return g.reshape(-1, ch, hi, wi).reshape(-1, *c["in_shape"])


def _upstream(spec: ModelSpec) -> dict[int, bool]:
    """Node -> whether it or a node it depends on has parameters (-1, the input: never): a
    gradient is only carried back to nodes marked True."""
    up: dict[int, bool] = {-1: False}
    for i, layer in enumerate(spec.layers):
        own = bool(_PARAMS.get(type(layer)))
        up[i] = own or any(up[j] for j in spec.node_inputs(i))
    return up


def _send(pending: dict[int, Any], up: dict[int, bool], j: int, d: Any) -> None:
    """Carry the gradient ``d`` back to node ``j`` (added to what other readers sent)."""
    if up.get(j):
        pending[j] = pending[j] + d if j in pending else d


def _route(layer: Any, srcs: Any, c: Any, d: Any, pending: dict[int, Any],
           up: dict[int, bool]) -> bool:
    """Carry ``d`` through a parameter-free graph node (Add: to every input; Concat: each
    input its channel slice); False for any other layer (the caller's backward)."""
    if isinstance(layer, Add):
        for j in srcs:
            _send(pending, up, j, d)
        return True
    if isinstance(layer, Concat):
        start = 0
        for j, size in zip(srcs, c["sizes"], strict=True):
            _send(pending, up, j, d[:, start : start + size])
            start += size
        return True
    return False


_PARAMS = {Linear: 2, Conv2d: 2, Conv1d: 2, LayerNorm: 2, GroupNorm: 2, Embedding: 1}


class PerSampleGrad(nn.Module):
    """forward(*params, [*masks,] x, y, clip) -> (norms, losses, *clipped_grad_sums).

    ``plain=True``: forward(*params, x, y) -> (losses, *grad_sums), the batch's summed
    gradient without per-sample norms or clipping (the device-level mode clips a device's
    whole update instead): the same backward pass, but each parameter's gradient is summed
    over the batch (no clip factors), and no per-sample squared norms are computed."""

    def __init__(self, spec: ModelSpec, *, masked: bool = False, plain: bool = False) -> None:
        super().__init__()
        if masked and plain:
            raise ValueError("a plain gradient graph has no masks (rand-k clips per sample)")
        self.spec = spec
        self.masked = masked
        self.plain = plain
        self.n_params = len(spec.param_shapes())

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        n = self.n_params
        if self.plain:
            return self._plain(args[:n], args[-2], args[-1])
        params, x, y, clip = args[:n], args[-3], args[-2], args[-1]
        masks = args[n : 2 * n] if self.masked else None
        h, cache = self._forward(params, x)
        logp = torch.log_softmax(h, dim=1)
        onehot = F.one_hot(y, self.spec.num_classes).to(h.dtype)
        losses = -(logp * onehot).sum(dim=1)
        d = torch.exp(logp) - onehot

        sq = torch.zeros_like(losses)
        saved: list[tuple[str, Any]] = []
        up = _upstream(self.spec)
        last = len(self.spec.layers) - 1
        pending: dict[int, Tensor] = {last: d}
        for i in range(last, -1, -1):
            if i not in pending:  # nothing upstream of this node has parameters
                continue
            layer, c, d = self.spec.layers[i], cache[i], pending.pop(i)
            srcs = self.spec.node_inputs(i)
            if _route(layer, srcs, c, d, pending, up):
                continue
            if isinstance(layer, Embedding):  # always the first layer: nothing below it
                onehot_ids = F.one_hot(c["ids"], layer.num_embeddings).to(d.dtype)
                gw = torch.matmul(onehot_ids.transpose(1, 2), d)  # B, V, D
                if masks is not None:
                    gw = gw * masks[c["pi"]]
                sq = sq + (gw * gw).sum(dim=(1, 2))
                saved.append(("embedding", (c["pi"], gw)))
                continue
            if isinstance(layer, Linear):
                a, pi = c["a"], c["pi"]
                if masks is None:
                    dd = (d * d).sum(dim=1)
                    sq = sq + dd * (a * a).sum(dim=1) + dd
                else:
                    d2 = d * d
                    sq = sq + ((d2 @ masks[pi]) * (a * a)).sum(dim=1) + d2 @ masks[pi + 1]
                saved.append(("linear", (pi, d, a)))
                if not up.get(srcs[0]):  # nothing below needs a gradient
                    continue
                d = d @ c["w"]
            elif isinstance(layer, Conv2d | Conv1d):
                dflat = d.reshape(d.shape[0], d.shape[1], -1)
                gw = conv_weight_grad(dflat, c["cols"], c["layer"].groups if "layer" in c else 1)
                gb = dflat.sum(dim=2)
                if masks is not None:
                    gw = gw * masks[c["pi"]].reshape(1, gw.shape[1], -1)
                    gb = gb * masks[c["pi"] + 1]
                sq = sq + (gw * gw).sum(dim=(1, 2)) + (gb * gb).sum(dim=1)
                saved.append(("conv", (c["pi"], gw, gb)))
                if not up.get(srcs[0]):
                    continue
                if "layer" in c:
                    d = conv_input_grad(d, c["w"], c["layer"], c["in_shape"])
                else:
                    d = F.conv_transpose2d(d, c["w"])
            elif isinstance(layer, MaxPool2d | MaxPool1d):
                d = (_unpool(d, c["winners"]) if "winners" in c
                     else max_pool_input_grad(d, c, layer))
            elif isinstance(layer, LayerNorm | GroupNorm):
                gw, gb = norm_backward(d, c, layer)
                if masks is not None:
                    gw, gb = gw * masks[c["pi"]], gb * masks[c["pi"] + 1]
                sq = sq + (gw * gw).flatten(1).sum(dim=1) + (gb * gb).flatten(1).sum(dim=1)
                saved.append(("norm", (c["pi"], gw, gb)))
                if not up.get(srcs[0]):
                    continue
                d = norm_input_grad(d, c)
            elif isinstance(layer, AvgPool2d | AvgPool1d):
                d = avg_unpool(d, layer, c["shape"])
            elif isinstance(layer, GlobalAvgPool):
                n = math.prod(c["shape"][1:])
                d = (d * (1.0 / n)).expand(-1, *c["shape"])
            elif isinstance(layer, ACTIVATIONS):
                d = d * c["mask"]
            elif isinstance(layer, Flatten):
                d = d.reshape((-1, *c["shape"]))
            _send(pending, up, srcs[0], d)

        norms = torch.sqrt(sq)
        scale = torch.clamp(clip / torch.clamp(norms, min=_TINY), max=1.0)
        grads: list[Tensor] = [torch.empty(0)] * self.n_params
        for kind, payload in saved:
            if kind == "embedding":
                pi, gw = payload
                grads[pi] = torch.einsum("b,bvd->vd", scale, gw)
            elif kind == "linear":
                pi, dl, a = payload
                ds = dl * scale[:, None]
                grads[pi] = ds.t() @ a
                grads[pi + 1] = ds.sum(dim=0)
                if masks is not None:
                    grads[pi] = grads[pi] * masks[pi]
                    grads[pi + 1] = grads[pi + 1] * masks[pi + 1]
            elif kind == "norm":
                pi, gw, gb = payload
                shape = self.spec.param_shapes()[pi][1]
                grads[pi] = (gw * scale.reshape(-1, *([1] * len(shape)))).sum(dim=0)
                grads[pi + 1] = (gb * scale.reshape(-1, *([1] * len(shape)))).sum(dim=0)
            else:
                pi, gw, gb = payload
                w_shape = self.spec.param_shapes()[pi][1]
                grads[pi] = torch.einsum("b,boi->oi", scale, gw).reshape(w_shape)
                grads[pi + 1] = (gb * scale[:, None]).sum(dim=0)
        return (norms, losses, *grads)


    def _forward(self, params: tuple[Tensor, ...], x: Tensor) -> tuple[Tensor, list]:
        """Logits and each layer's backward cache."""
        cache: list[dict[str, Any]] = []
        outs: list[Tensor] = []
        pi = 0
        for i, layer in enumerate(self.spec.layers):
            srcs = self.spec.node_inputs(i)
            h = x if srcs[0] < 0 else outs[srcs[0]]
            if isinstance(layer, Add):
                cache.append({})
                for j in srcs[1:]:
                    h = h + (x if j < 0 else outs[j])
            elif isinstance(layer, Concat):
                parts = [x if j < 0 else outs[j] for j in srcs]
                cache.append({"sizes": [int(t.shape[1]) for t in parts]})
                h = torch.cat(parts, dim=1)
            elif isinstance(layer, Embedding):
                cache.append({"ids": h, "pi": pi})
                h = params[pi][h]
                pi += 1
            elif isinstance(layer, Linear):
                w, b = params[pi], params[pi + 1]
                cache.append({"a": h, "w": w, "pi": pi})
                h = h @ w.t() + b
                pi += 2
            elif _plain(layer):
                w, b = params[pi], params[pi + 1]
                k = layer.kernel
                ho, wo = h.shape[2] - k + 1, h.shape[3] - k + 1
                cols = im2col(h, k)
                out = torch.matmul(w.reshape(layer.out_channels, -1), cols) + b[:, None]
                cache.append({"cols": cols, "w": w, "pi": pi})
                h = out.reshape(-1, layer.out_channels, ho, wo)
                pi += 2
            elif isinstance(layer, Conv2d | Conv1d):
                w, b = params[pi], params[pi + 1]
                cols, ho, wo = conv_cols(h if isinstance(layer, Conv2d) else h.unsqueeze(2),
                                         layer)
                out = conv_apply(w, cols, layer.groups) + b[:, None]
                cache.append({"cols": cols, "w": w, "pi": pi, "layer": layer,
                              "in_shape": tuple(h.shape[1:])})
                shape = (ho, wo) if isinstance(layer, Conv2d) else (wo,)
                h = out.reshape(-1, layer.out_channels, *shape)
                pi += 2
            elif _pair_pool(layer, h):
                h, winners = _pool_masks(h)
                cache.append({"winners": winners})
            elif isinstance(layer, MaxPool2d | MaxPool1d):
                h, saved_pool = max_pool_forward(h, layer)
                cache.append(saved_pool)
            elif isinstance(layer, LayerNorm | GroupNorm):
                h, saved_norm = norm_forward(h, params[pi], params[pi + 1], layer)
                cache.append({**saved_norm, "pi": pi})
                pi += 2
            elif isinstance(layer, AvgPool2d | AvgPool1d):
                cache.append({"shape": tuple(h.shape[1:])})
                h = avg_pool(h, layer)
            elif isinstance(layer, GlobalAvgPool):
                cache.append({"shape": tuple(h.shape[1:])})
                h = h.mean(dim=tuple(range(2, 2 + layer.dims)), keepdim=True)
            elif isinstance(layer, Relu):
                cache.append({"mask": (h > 0).to(h.dtype)})
                h = torch.relu(h)
            elif isinstance(layer, ACTIVATIONS):
                h, deriv = activation(layer, h)
                cache.append({"mask": deriv})
            elif isinstance(layer, Flatten):
                cache.append({"shape": h.shape[1:]})
                h = h.reshape(h.shape[0], -1)
            outs.append(h)

        return h, cache

    def _plain(self, params: tuple[Tensor, ...], x: Tensor, y: Tensor) -> tuple[Tensor, ...]:
        h, cache = self._forward(params, x)
        logp = torch.log_softmax(h, dim=1)
        onehot = F.one_hot(y, self.spec.num_classes).to(h.dtype)
        losses = -(logp * onehot).sum(dim=1)
        up = _upstream(self.spec)
        last = len(self.spec.layers) - 1
        pending: dict[int, Tensor] = {last: torch.exp(logp) - onehot}
        grads: list[Tensor] = [torch.empty(0)] * self.n_params
        for i in range(last, -1, -1):
            if i not in pending:
                continue
            layer, c, d = self.spec.layers[i], cache[i], pending.pop(i)
            srcs = self.spec.node_inputs(i)
            if _route(layer, srcs, c, d, pending, up):
                continue
            if isinstance(layer, Embedding):
                onehot_ids = F.one_hot(c["ids"], layer.num_embeddings).to(d.dtype)
                rows = onehot_ids.reshape(-1, layer.num_embeddings)
                grads[c["pi"]] = rows.t() @ d.reshape(rows.shape[0], -1)
                continue
            if isinstance(layer, Linear):
                grads[c["pi"]] = d.t() @ c["a"]
                grads[c["pi"] + 1] = d.sum(dim=0)
                if not up.get(srcs[0]):
                    continue
                d = d @ c["w"]
            elif isinstance(layer, Conv2d | Conv1d):
                dflat = d.reshape(d.shape[0], d.shape[1], -1)
                # the batched per-sample MatMul, then a sum over the batch: measured faster in
                # onnxruntime than one contraction over batch and positions, whose transposed
                # copy of the columns costs more than the [B, out, C*k*k] it saves
                gw = conv_weight_grad(dflat, c["cols"], c["layer"].groups if "layer" in c else 1)
                w_shape = self.spec.param_shapes()[c["pi"]][1]
                grads[c["pi"]] = gw.sum(dim=0).reshape(w_shape)
                grads[c["pi"] + 1] = dflat.sum(dim=(0, 2))
                if not up.get(srcs[0]):
                    continue
                if "layer" in c:
                    d = conv_input_grad(d, c["w"], c["layer"], c["in_shape"])
                else:
                    d = F.conv_transpose2d(d, c["w"])
            elif isinstance(layer, MaxPool2d | MaxPool1d):
                d = (_unpool(d, c["winners"]) if "winners" in c
                     else max_pool_input_grad(d, c, layer))
            elif isinstance(layer, LayerNorm | GroupNorm):
                gw, gb = norm_backward(d, c, layer)
                grads[c["pi"]], grads[c["pi"] + 1] = gw.sum(dim=0), gb.sum(dim=0)
                if not up.get(srcs[0]):
                    continue
                d = norm_input_grad(d, c)
            elif isinstance(layer, AvgPool2d | AvgPool1d):
                d = avg_unpool(d, layer, c["shape"])
            elif isinstance(layer, GlobalAvgPool):
                n = math.prod(c["shape"][1:])
                d = (d * (1.0 / n)).expand(-1, *c["shape"])
            elif isinstance(layer, ACTIVATIONS):
                d = d * c["mask"]
            elif isinstance(layer, Flatten):
                d = d.reshape((-1, *c["shape"]))
            _send(pending, up, srcs[0], d)
        return (losses, *grads)


class Logits(nn.Module):
    """forward(*params, x) -> logits, the inference graph with weights as inputs."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.n_params = len(spec.param_shapes())

    def forward(self, *args: Tensor) -> Tensor:
        params, x, pi = args[: self.n_params], args[-1], 0
        outs: list[Tensor] = []
        for i, layer in enumerate(self.spec.layers):
            srcs = self.spec.node_inputs(i)
            h = x if srcs[0] < 0 else outs[srcs[0]]
            if isinstance(layer, Add):
                for j in srcs[1:]:
                    h = h + (x if j < 0 else outs[j])
            elif isinstance(layer, Concat):
                h = torch.cat([x if j < 0 else outs[j] for j in srcs], dim=1)
            elif isinstance(layer, Embedding):
                h = params[pi][h]
                pi += 1
            elif isinstance(layer, Linear):
                h = h @ params[pi].t() + params[pi + 1]
                pi += 2
            elif _plain(layer):
                h = F.conv2d(h, params[pi], params[pi + 1])
                pi += 2
            elif isinstance(layer, Conv2d):
                h = F.conv2d(h, params[pi], params[pi + 1], stride=layer.stride,
                             padding=layer.padding, dilation=layer.dilation, groups=layer.groups)
                pi += 2
            elif isinstance(layer, Conv1d):
                h = F.conv1d(h, params[pi], params[pi + 1], stride=layer.stride,
                             padding=layer.padding, dilation=layer.dilation, groups=layer.groups)
                pi += 2
            elif _pair_pool(layer, h):
                h = F.max_pool2d(h, 2)
            elif isinstance(layer, MaxPool2d):
                h = F.max_pool2d(h, layer.kernel, layer.stride)
            elif isinstance(layer, MaxPool1d):
                h = F.max_pool1d(h, layer.kernel, layer.stride)
            elif isinstance(layer, Relu):
                h = torch.relu(h)
            elif isinstance(layer, LayerNorm | GroupNorm):
                h = norm_forward(h, params[pi], params[pi + 1], layer)[0]
                pi += 2
            elif isinstance(layer, AvgPool2d | AvgPool1d):
                h = avg_pool(h, layer)
            elif isinstance(layer, GlobalAvgPool):
                h = h.mean(dim=tuple(range(2, 2 + layer.dims)), keepdim=True)
            elif isinstance(layer, ACTIVATIONS):
                h = activation(layer, h)[0]
            elif isinstance(layer, Flatten):
                h = h.reshape(h.shape[0], -1)
            outs.append(h)
        return h
