"""Generated gRPC/protobuf code for corpusd.v1 (see tools/gen_protos.py)."""
