"""`python -m executor_svc.cpu_kernels`: build (or check) the CPU kernels now."""

from executor_svc.cpu_kernels import SOURCES, build_all, build_root

if __name__ == "__main__":
    build_all()
    print(f"CPU kernels ready: {', '.join(SOURCES)} in {build_root()}")
