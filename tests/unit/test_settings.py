import pytest

from livemig.errors import UsageError
from livemig.settings import merge, parse_sets, profile_settings, resolve

CAPS = {"auto-converge": False, "multifd": False, "xbzrle": False, "postcopy-ram": False}
PARAMS = {"max-bandwidth": 0, "multifd-compression": "none", "multifd-channels": 2,
          "block-incremental": False}


def test_resolve_kinds_and_types():
    r = resolve({"auto-converge": "on", "max-bandwidth": "64M", "multifd-compression": "zstd",
                 "multifd-channels": "4", "warmup": "1.5"}, CAPS, PARAMS)
    assert r.capabilities == {"auto-converge": True}
    assert r.parameters == {"max-bandwidth": 64 << 20, "multifd-compression": "zstd",
                            "multifd-channels": 4}
    assert r.livemig["warmup"] == 1.5 and r.livemig["settle"] == 2.0


@pytest.mark.parametrize(("wanted", "msg"), [
    ({"no-such-thing": "1"}, "unknown setting"),
    ({"multifd": "maybe"}, "expected on or off"),
    ({"multifd-channels": "lots"}, "bad"),
    ({"warmup": "soon"}, "bad --set warmup"),
])
def test_resolve_errors(wanted, msg):
    with pytest.raises(UsageError, match=msg):
        resolve(wanted, CAPS, PARAMS)


def test_a_misspelt_setting_names_the_closest_one():
    with pytest.raises(UsageError, match="did you mean 'max-bandwidth'"):
        resolve({"max-bandwith": "1G"}, CAPS, PARAMS)
    with pytest.raises(UsageError, match="did you mean 'poll-interval'"):
        resolve({"poll-intervall": "1"}, CAPS, PARAMS)
    with pytest.raises(UsageError) as e:
        resolve({"no-such-thing": "1"}, CAPS, PARAMS)
    assert "did you mean" not in str(e.value)


def test_settings_that_need_capabilities():
    r = resolve({"throttle": "auto-converge", "on-stall": "postcopy"}, CAPS, PARAMS)
    assert r.capabilities == {"auto-converge": True, "postcopy-ram": True}
    assert r.livemig["on-stall"] == "postcopy"


def test_asking_for_a_multifd_codec_means_multifd():
    w = merge("livemig", {"multifd-compression": "lz4"})
    assert w["multifd"] == "on" and w.get("xbzrle", "off") == "off"
    assert w["throttle"] == "converge"
    w = merge("upstream-xbzrle", {"multifd-compression": "lz4"})
    assert w["multifd"] == "on" and w["xbzrle"] == "off"
    w = merge("livemig", {"multifd-compression": "lz4", "xbzrle": "on"})
    assert w["xbzrle"] == "on"  # explicit: QEMU will refuse with its own reason
    w = merge("upstream-plain", {"multifd-compression": "none"})
    assert "multifd" not in w


def test_parse_sets():
    assert parse_sets(["a=1", "b = on"]) == {"a": "1", "b": "on"}
    with pytest.raises(UsageError):
        parse_sets(["novalue"])


def test_profiles():
    assert profile_settings("upstream")["multifd-compression"] == "zstd"
    with pytest.raises(UsageError):
        profile_settings("fastest")
