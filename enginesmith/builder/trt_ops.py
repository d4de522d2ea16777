"""What TensorRT's ONNX parser accepts, per TensorRT version: data for builder/trt_lint.py.

Source: onnx-tensorrt `docs/operators.md` (the 10.1 and 10.15 GA tables) and its CHANGELOG.md
(versions that added ops). TensorRT 11.x documents the same opset range (9-24) and table as 10.15.
The opset ceilings between 10.1 and 10.15 are not published; they are inferred from the ONNX
release the parser bundles per its changelog (10.6: ONNX 1.17 = opset 22, 10.11: ONNX 1.18 =
opset 23) and marked as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Version = tuple[int, int]

# (first TensorRT version, highest default-domain opset the parser documents)
OPSET_CEILINGS: tuple[tuple[Version, int, str], ...] = (
    ((10, 0), 20, "documented (operators.md 10.0/10.1)"),
    ((10, 6), 22, "inferred: the parser bundles ONNX 1.17"),
    ((10, 11), 23, "inferred: the parser bundles ONNX 1.18"),
    ((10, 15), 24, "documented (operators.md 10.15)"),
    ((11, 0), 24, "documented (TensorRT 11 operators.md)"),
)
MIN_OPSET = 9
KNOWN_TARGETS: tuple[Version, ...] = ((10, 0), (10, 3), (10, 13), (10, 14), (10, 15), (11, 0))
DEFAULT_TARGET = "10.15"

# Supported ("Y") in the 10.1 table, so in every 10.x we target.
_SINCE_10_0 = """
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast CastLike
Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DeformConv DepthToSpace
DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements
GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample
GroupNormalization GRU HardSigmoid HardSwish Hardmax Identity If ImageScaler InstanceNormalization IsInf
IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool
MatMul Max MaxPool Mean MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not
OneHot Or Pad ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean
ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RNN RoiAlign Round
ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice
Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile TopK
Transpose Trilu Unsqueeze Upsample Where Xor
""".split()

# Added later (CHANGELOG.md); DeformConv arrived in 10.1 but 10.0 is rarely targeted.
_ADDED: dict[str, Version] = {
    "DeformConv": (10, 1), "BlackmanWindow": (10, 4), "HammingWindow": (10, 4), "HannWindow": (10, 4),
    "STFT": (10, 5), "Attention": (10, 14),
    "RMSNormalization": (10, 15), "RotaryEmbedding": (10, 15), "TensorScatter": (10, 15),
}

# "N" in the 10.15 table, with the table's note where it has one.
UNSUPPORTED: dict[str, str] = {
    **{op: "" for op in """AffineGrid Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Col2Im
       CenterCropPad Compress ConcatFromSequence ConvInteger DFT Det ImageDecoder MatMulInteger MaxRoiPool
       MaxUnpool MelWeightMatrix Multinomial NegativeLogLikelihoodLoss Optional OptionalGetElement
       OptionalHasElement QLinearConv QLinearMatMul RegexFullMatch SequenceAt SequenceConstruct SequenceEmpty
       SequenceErase SequenceInsert SequenceLength SequenceMap SoftmaxCrossEntropyLoss SplitToSequence
       StringConcat StringNormalizer StringSplit TfIdfVectorizer Unique""".split()},
    "DynamicQuantizeLinear": "compose TensorRT's IDynamicQuantize from ONNX ops in a model local function",
}


def supported_since(op_type: str) -> Version | None:
    """First TensorRT version whose parser imports `op_type` (default domain), or None."""
    if op_type in _ADDED:
        return _ADDED[op_type]
    if op_type in _SINCE_10_0:
        return (10, 0)
    return None


def opset_ceiling(target: Version) -> tuple[int, str]:
    best = OPSET_CEILINGS[0]
    for entry in OPSET_CEILINGS:
        if entry[0] <= target:
            best = entry
    return best[1], best[2]


def parse_target(text: str) -> Version:
    """'10.15', '10.15.1', 'trt-10.13', '11' -> (major, minor); a bare major means its newest we know."""
    cleaned = text.strip().lower().removeprefix("tensorrt").removeprefix("trt").strip("-_ v")
    parts = cleaned.split(".")
    try:
        major = int(parts[0])
        minor = int(parts[1]) if len(parts) > 1 and parts[1] not in ("x", "") else None
    except ValueError:
        raise ValueError(f"not a TensorRT version: {text!r}") from None
    if major < 10:
        raise ValueError(f"TensorRT {text} is older than 10.0, which enginesmith does not target")
    if minor is None:
        minor = max((v[1] for v in KNOWN_TARGETS if v[0] == major), default=0)
    return (major, minor)


# ---------------------------------------------------------------------------- our plugin creators

@dataclass(frozen=True)
class PluginField:
    name: str
    kind: str            # "int32" (ONNX INT attribute), "float32" (FLOAT), "half-tensor" (TENSOR fp16/bf16)
    required: bool = False


@dataclass(frozen=True)
class PluginCreator:
    name: str
    version: str
    namespace: str
    fields: tuple[PluginField, ...] = field(default_factory=tuple)


# Mirrors the creators in plugins/*/…_plugin.cpp (getFieldNames() and createPlugin's required reads);
# tests/builder/test_trt_lint.py re-reads the C++ sources and fails if this table drifts.
PLUGIN_CREATORS: tuple[PluginCreator, ...] = (
    PluginCreator("PagedAttention", "1", "enginesmith", (
        PluginField("num_heads", "int32", True), PluginField("num_kv_heads", "int32", True),
        PluginField("head_size", "int32", True), PluginField("block_size", "int32", True),
        PluginField("scale", "float32"), PluginField("write_kv", "int32"), PluginField("max_splits", "int32"),
    )),
    PluginCreator("SparseGemm24", "1", "enginesmith", (
        PluginField("weight", "half-tensor", True), PluginField("out_features", "int32", True),
        PluginField("in_features", "int32", True),
    )),
)
# Attributes the parser consumes itself instead of passing them to the creator.
PARSER_PLUGIN_ATTRIBUTES = frozenset({"plugin_version", "plugin_namespace", "tensorrt_plugin_shape_input_indices"})
NAMESPACE_FROM_DOMAIN_SINCE: Version = (10, 10)  # "Plugin fallback importer now also reads its namespace from a Node's domain"
