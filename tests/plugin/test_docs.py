"""`/openapi.json` describes each decision route's request body, and `/docs` needs no internet."""

import httpx


def test_the_openapi_document_has_each_decision_routes_request_body(demo_server):
    paths = httpx.get(f"{demo_server.url}/openapi.json", timeout=30).json()["paths"]
    bodies = {path: paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
              for path in ("/v1/systemone", "/v1/systemone/batch", "/v1/chat/completions")}
    assert bodies["/v1/systemone"]["required"] == ["state", "questions"]
    question = bodies["/v1/systemone"]["properties"]["questions"]["additionalProperties"]
    assert question["properties"]["type"]["enum"] == ["noul", "choice", "score"]
    assert bodies["/v1/systemone/batch"]["properties"]["states"]["type"] == "array"
    chat = bodies["/v1/chat/completions"]
    assert {"model", "messages", "response_format"} <= set(chat["properties"]) and "$ref" not in str(chat)


def test_docs_load_everything_from_this_server(demo_server):
    page = httpx.get(f"{demo_server.url}/docs", timeout=30)
    assert page.status_code == 200 and "swagger-ui-bundle.js" in page.text
    assert "cdn." not in page.text and "https://" not in page.text.replace("https://swagger.io", "")
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png"):
        served = httpx.get(f"{demo_server.url}/docs/assets/{asset}", timeout=30)
        assert served.status_code == 200 and len(served.content) > 500, asset
    assert httpx.get(f"{demo_server.url}/redoc", timeout=30).status_code == 404
