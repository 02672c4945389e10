"""The tool both framework examples give their agent: safe arithmetic on ``+ - * /`` and
parentheses (no ``eval``). Plain Python; each framework wraps it its own way."""

import ast
import operator

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}

DESCRIPTION = "Evaluate an arithmetic expression such as 2+3 or (4*5)-1."


def calculate(expression: str) -> str:
    """The value of ``expression`` as text (an int when whole), or an error message the model
    reads as the tool's result."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else str(result)
