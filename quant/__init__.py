"""deepinfer.quant"""
