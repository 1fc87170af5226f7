"""`python -m executor_svc.cpu_kernels`: build (or check) every CPU kernel module now."""

from executor_svc.cpu_kernels import MODULES, build_all, build_root

if __name__ == "__main__":
    build_all()
    print(f"CPU kernels ready: {', '.join(MODULES)} in {build_root()}")
