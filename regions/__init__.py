"""deepinfer.regions"""
