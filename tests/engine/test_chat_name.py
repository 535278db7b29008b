"""A chat message's `name` (OpenAI's participant name) reaches the chat template, as vLLM passes it: it was dropped,
so a template that renders it rendered another prompt than the client asked for (session 75, from the server
audit). Not a string: refused naming it."""
import pytest

from mpk_runtime.engine import InvalidRequestError
from mpk_runtime.engine.chat import check_messages, render_chat

TEMPLATE = ("{% for m in messages %}{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}: {{ m.content }}\n"
            "{% endfor %}assistant:")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from mpk_runtime.engine.demo_model import save_demo_model
    t = AutoTokenizer.from_pretrained(save_demo_model(str(tmp_path_factory.mktemp("demo") / "demo")))
    t.chat_template = TEMPLATE
    return t


def test_name_reaches_the_template(tok):
    _, text = render_chat(tok, [{"role": "user", "name": "ada", "content": "hi"}, {"role": "user", "content": "yo"}])
    assert text == "user (ada): hi\nuser: yo\nassistant:"
    assert check_messages([{"role": "user", "content": "hi", "name": None}]) == [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match=r"messages\[0\].name"):
        check_messages([{"role": "user", "content": "hi", "name": 3}])

