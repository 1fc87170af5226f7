"""Generated gRPC code lives here (see setup.py); only the .proto files are sources."""
