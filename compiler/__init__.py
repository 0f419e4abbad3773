"""deepinfer.compiler"""
