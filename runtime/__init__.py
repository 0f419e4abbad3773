"""deepinfer.runtime"""
