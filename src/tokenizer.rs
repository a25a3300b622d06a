//! The model's tokenizer (tokenizer.json through the `tokenizers` crate) and
//! its chat template (tokenizer_config.json or chat_template.jinja, rendered
//! with minijinja the way transformers renders it with Jinja2).

use serde_json::Value;
use std::path::{Path, PathBuf};

/// A tokenizer file could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", path.display())]
pub struct TokenizerError {
    pub path: PathBuf,
    pub message: String,
}

fn terr(path: &Path, message: impl Into<String>) -> TokenizerError {
    TokenizerError {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// One chat message (`role` is system, user, assistant, …).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// tokenizer.json
    pub path: PathBuf,
    /// Special tokens named in tokenizer_config.json (bos_token, eos_token, …).
    pub special: Vec<(String, String)>,
    pub chat_template: Option<String>,
    /// Where the chat template came from (for messages).
    pub chat_template_source: Option<PathBuf>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab", &self.vocab_size())
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// A special token in tokenizer_config.json: a string or {"content": ...}.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// Load `dir/tokenizer.json` (required) and, when present,
    /// `dir/tokenizer_config.json` and `dir/chat_template.jinja`.
    pub fn load(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|e| terr(&path, format!("cannot read: {e}")))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| terr(&path, format!("not a valid tokenizers file: {e}")))?;
        let mut tok = Tokenizer {
            inner,
            path,
            special: Vec::new(),
            chat_template: None,
            chat_template_source: None,
        };
        let cfg_path = dir.join("tokenizer_config.json");
        if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path)
                .map_err(|e| terr(&cfg_path, format!("cannot read: {e}")))?;
            let cfg: Value = serde_json::from_str(&text)
                .map_err(|e| terr(&cfg_path, format!("not valid JSON: {e}")))?;
            let obj = cfg
                .as_object()
                .ok_or_else(|| terr(&cfg_path, "expected a JSON object"))?;
            for key in ["bos_token", "eos_token", "unk_token", "pad_token"] {
                match obj.get(key) {
                    None | Some(Value::Null) => {}
                    Some(v) => match token_text(v) {
                        Some(t) => tok.special.push((key.to_string(), t)),
                        None => {
                            return Err(terr(
                                &cfg_path,
                                format!("{key} must be a string or {{\"content\": ...}}"),
                            ))
                        }
                    },
                }
            }
            match obj.get("chat_template") {
                None | Some(Value::Null) => {}
                Some(Value::String(s)) => tok.chat_template = Some(s.clone()),
                // A list of named templates: use "default" (transformers does).
                Some(Value::Array(items)) => {
                    let named = items
                        .iter()
                        .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"));
                    match named
                        .and_then(|t| t.get("template"))
                        .and_then(|t| t.as_str())
                    {
                        Some(s) => tok.chat_template = Some(s.to_string()),
                        None => {
                            return Err(terr(
                                &cfg_path,
                                "chat_template is a list without a \"default\" template",
                            ))
                        }
                    }
                }
                Some(_) => {
                    return Err(terr(
                        &cfg_path,
                        "chat_template must be a string or a list of {name, template}",
                    ))
                }
            }
            if tok.chat_template.is_some() {
                tok.chat_template_source = Some(cfg_path.clone());
            }
        }
        // transformers 5 saves the template beside the config; it wins.
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            let t = std::fs::read_to_string(&jinja)
                .map_err(|e| terr(&jinja, format!("cannot read: {e}")))?;
            tok.chat_template = Some(t);
            tok.chat_template_source = Some(jinja);
        }
        for (key, text) in &tok.special {
            if tok.inner.token_to_id(text).is_none() {
                return Err(terr(
                    &tok.path,
                    format!("{key} {text:?} (from tokenizer_config.json) is not in the vocabulary"),
                ));
            }
        }
        Ok(tok)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The text of a special token named in tokenizer_config.json.
    pub fn special_token(&self, key: &str) -> Option<&str> {
        self.special
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Token ids of `text`. `add_special` applies the tokenizer's
    /// post-processor (e.g. a BOS token), as transformers does by default.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(|e| terr(&self.path, format!("cannot encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| terr(&self.path, format!("cannot decode: {e}")))
    }

    /// Render the chat template for `messages`, as transformers'
    /// `apply_chat_template(..., tokenize=False)` does.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.apply_chat_template_with(messages, add_generation_prompt, None)
    }

    /// [`Tokenizer::apply_chat_template`] with `enable_thinking` passed to
    /// the template when given (the variable Qwen3's template reads).
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String, TokenizerError> {
        let source = self.chat_template_source.as_deref().unwrap_or(&self.path);
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| terr(&self.path, "this model has no chat template (tokenizer_config.json has no chat_template and there is no chat_template.jinja)"))?;
        let mut env = minijinja::Environment::new();
        // transformers renders with trim_blocks and lstrip_blocks on.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_filter("tojson", python_tojson);
        env.add_template("chat", template)
            .map_err(|e| terr(source, format!("chat template does not parse: {e}")))?;
        let mut ctx = serde_json::Map::new();
        ctx.insert(
            "messages".into(),
            serde_json::to_value(messages).unwrap_or(Value::Null),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        for (k, v) in &self.special {
            ctx.insert(k.clone(), Value::String(v.clone()));
        }
        if let Some(t) = enable_thinking {
            ctx.insert("enable_thinking".into(), Value::Bool(t));
        }
        let tmpl = env
            .get_template("chat")
            .map_err(|e| terr(source, e.to_string()))?;
        tmpl.render(minijinja::Value::from_serialize(&ctx))
            .map_err(|e| terr(source, format!("chat template failed: {e}")))
    }
}

/// Python's `json.dumps(v, ensure_ascii=False)` (what transformers' `tojson`
/// filter does): ", " and ": " separators, or newlines with `indent`.
fn python_tojson(
    v: minijinja::Value,
    indent: Option<usize>,
) -> Result<minijinja::Value, minijinja::Error> {
    let json: Value = serde_json::to_value(&v).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    })?;
    let mut out = String::new();
    dump_py(&json, indent, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

fn dump_py(v: &Value, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, d: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * d));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                dump_py(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                dump_py(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}
