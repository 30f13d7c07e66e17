"""``livemig evacuate``: empty a libvirt host, scheduled against the shared link."""
