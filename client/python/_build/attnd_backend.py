"""A PEP 517 build backend that writes the attnd wheel itself (standard library only, so pip needs nothing
from a registry): the attnd/ package, its lib/ folder included, and the dist-info files."""
import base64
import hashlib
import os
import sysconfig
import zipfile

NAME, VERSION = "attnd", "0.1.0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST_INFO = f"{NAME}-{VERSION}.dist-info"
METADATA = (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
            "Summary: attnd client: fused attention as a service, from NumPy and PyTorch\nRequires-Python: >=3.9\n")


def _files():
    pkg = os.path.join(ROOT, NAME)
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            if f.endswith((".py", ".so", ".txt")) or ".so." in f:
                full = os.path.join(dirpath, f)
                yield full, os.path.relpath(full, ROOT).replace(os.sep, "/")


def _tag():
    # A wheel with the native library is for this platform; without it (a source-only build) for any.
    native = any(".so" in arc for _, arc in _files())
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_") if native else "any"
    return f"py3-none-{plat}"


def _record_line(arc, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arc},sha256={digest},{len(data)}"


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    d = os.path.join(metadata_directory, DIST_INFO)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(METADATA)
    return DIST_INFO


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    tag = _tag()
    name = f"{NAME}-{VERSION}-{tag}.whl"
    wheel_meta = f"Wheel-Version: 1.0\nGenerator: attnd_backend\nRoot-Is-Purelib: false\nTag: {tag}\n"
    records = []
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        for full, arc in _files():
            with open(full, "rb") as f:
                data = f.read()
            info = zipfile.ZipInfo(arc, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (os.stat(full).st_mode & 0o777) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
            records.append(_record_line(arc, data))
        for fname, text in (("METADATA", METADATA), ("WHEEL", wheel_meta), ("top_level.txt", NAME + "\n")):
            arc = f"{DIST_INFO}/{fname}"
            z.writestr(arc, text)
            records.append(_record_line(arc, text.encode()))
        records.append(f"{DIST_INFO}/RECORD,,")
        z.writestr(f"{DIST_INFO}/RECORD", "\n".join(records) + "\n")
    return name


def build_sdist(sdist_directory, config_settings=None):
    import tarfile
    name = f"{NAME}-{VERSION}"
    path = os.path.join(sdist_directory, name + ".tar.gz")
    with tarfile.open(path, "w:gz") as t:
        for rel in ("pyproject.toml", "_build/attnd_backend.py"):
            t.add(os.path.join(ROOT, rel), f"{name}/{rel}")
        for full, arc in _files():
            t.add(full, f"{name}/{arc}")
        info = tarfile.TarInfo(f"{name}/PKG-INFO")
        data = METADATA.encode()
        info.size = len(data)
        import io
        t.addfile(info, io.BytesIO(data))
    return name + ".tar.gz"
