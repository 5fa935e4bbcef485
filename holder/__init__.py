"""Holder: the pinned page store, partial-attention kernels and the holder gRPC service.

Built by the holder issue; nothing here yet but the package boundary.
"""
