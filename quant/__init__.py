"""deepinfer.quant: host-side numpy preprocessing of quantized weights.

Modules (bit formats are documented byte by byte in each):
  fp8        e4m3fn decode (256-entry LUT) / encode (RNE, saturating, NaN kept)
  ue8m0      exponent-only scale bytes, pow2ceil, the release's scale rule
  blockfp8   block-quantized fp8 weights (quantize / dequantize)
  fp4        e2m1 and MXFP4 (two codes per byte, low nibble = even element)
  formats    device fp8 formats ("e4m3fn", IEEE-like "e4m3") and their names
  shift      power-of-two rescaling of fp8 codes in the uint8 domain
  rescale    rescale to ue8m0 scales of another block size; e4m3fn -> e4m3
  pack       packed scale layouts (int32 MN-major, int16 pairs) and their names
  stream_plan, stream
             the streaming driver over a safetensors checkpoint (headers and memory maps:
             deepinfer.bundles.safetensors)

No torch in any of them: torch is only the reference the tests compare against.
"""
