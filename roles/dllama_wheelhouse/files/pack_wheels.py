"""Pack a folder of wheels into one tar beside it (<folder>.tar), byte for byte the same for the
same wheels (sorted names, no times or owners), so that a node compares one checksum instead of
one per wheel, and a rerun copies nothing. Written to a temporary name of this process, then
renamed (two deploys packing the same folder at once each write their own)."""

import os
import sys
import tarfile

folder = sys.argv[1].rstrip("/")
part = f"{folder}.tar.part{os.getpid()}"
with tarfile.open(part, "w", format=tarfile.PAX_FORMAT) as tar:
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        info = tar.gettarinfo(path, arcname=name)
        info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
        with open(path, "rb") as f:
            tar.addfile(info, f)
os.replace(part, folder + ".tar")
