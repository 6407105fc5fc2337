"""A scripted environment for the end-to-end tests (--env=multiturn_env:Echo, importable from tests/): after each
turn of the policy, an observation made of the trajectory so far, so that it is the same on every layout and on
resume, of a length that varies from row to row."""


class Echo:
    stop = ('+',)  # a turn also ends at a '+' the policy writes, not only at its end of text

    def step(self, row, text):
        return f"[{len(text)}{text[-1:]}]" if text else "[]"


class CalcTags(Echo):
    stop = ('</calc>',)  # seven bytes: a turn ends where the text comes to end with them


class BareStop(Echo):
    stop = '</calc>'  # a string, not a tuple of them: refused
