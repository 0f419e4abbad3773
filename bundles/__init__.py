"""deepinfer.bundles"""
