"""The shared name registry behind every `config value -> component` choice."""
import pytest

from protocol.registry import Registry


class Boom(ValueError):
    pass


def test_register_get_names_unregister():
    reg = Registry("widget", key="a.widget", error=Boom)

    @reg.register("b")
    def b():
        return 2

    reg.register("a")(len)
    assert reg.names() == ["a", "b"] and "b" in reg and reg.get("b")() == 2
    reg.register("b")(b)  # the same object again is fine
    with pytest.raises(Boom, match="widget 'b' is already registered"):
        reg.register("b")(len)
    with pytest.raises(Boom, match=r"a.widget='c' is not a known widget; known: \['a', 'b'\]"):
        reg.get("c")
    assert reg.unregister("b") is b and reg.names() == ["a"]
    with pytest.raises(Boom, match="not registered"):
        reg.unregister("b")


def test_check_and_bad_names():
    reg = Registry("loop")

    def only_types(obj):
        if not isinstance(obj, type):
            raise TypeError("a class, please")

    with pytest.raises(TypeError, match="a class"):
        reg.register("x", check=only_types)(len)
    with pytest.raises(ValueError, match="non-empty str"):
        reg.register("")
    with pytest.raises(ValueError, match="unknown loop 'y'"):
        reg.get("y")
