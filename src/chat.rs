//! Chat prompts. Most families carry their conversation format as a jinja
//! chat template (rendered by `Tokenizer::apply_chat_template`); DeepSeek V4
//! defines it in code instead (`encoding/encoding_dsv4.py` beside the
//! checkpoint), so its format is written out here.

use crate::tokenizer::{ChatMessage, Tokenizer};

/// DeepSeek V4's special strings (each one token in its tokenizer.json).
pub const DSV4_BOS: &str = "<｜begin▁of▁sentence｜>";
pub const DSV4_EOS: &str = "<｜end▁of▁sentence｜>";
pub const DSV4_USER: &str = "<｜User｜>";
pub const DSV4_ASSISTANT: &str = "<｜Assistant｜>";
pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";

/// DeepSeek V4's prompt for a plain conversation (system, user and
/// assistant messages; no tools), as its encoding renders it with the
/// default settings (BOS added, earlier turns' reasoning dropped):
///
/// * BOS, then a system message's text as it is;
/// * a user message as `<｜User｜>text`; the last one, or one an assistant
///   message follows, then opens the assistant turn: `<｜Assistant｜>` and
///   `<think>` in thinking mode for the last user message, `</think>`
///   otherwise (chat mode, or an earlier turn);
/// * an assistant message as its text and EOS (in thinking mode, one after
///   the last user message is preceded by `</think>`: its reasoning is empty).
///
/// `thinking` picks the encoding's `thinking_mode` ("thinking" or "chat").
pub fn deepseek_v4(messages: &[ChatMessage], thinking: bool) -> Result<String, String> {
    let last_user = messages.iter().rposition(|m| m.role == "user");
    let mut out = String::from(DSV4_BOS);
    for (i, m) in messages.iter().enumerate() {
        match m.role.as_str() {
            "system" => out.push_str(&m.content),
            "user" => {
                out.push_str(DSV4_USER);
                out.push_str(&m.content);
            }
            "assistant" => {
                if thinking && last_user.is_some_and(|u| i > u) {
                    out.push_str(THINK_CLOSE);
                }
                out.push_str(&m.content);
                out.push_str(DSV4_EOS);
            }
            other => {
                return Err(format!(
                    "DeepSeek V4 chat: message {i} has role {other:?}; this encoding takes system, user and assistant messages"
                ))
            }
        }
        let next_is_reply = messages.get(i + 1).map_or(true, |n| n.role == "assistant");
        if m.role == "user" && next_is_reply {
            out.push_str(DSV4_ASSISTANT);
            let opens_thinking = thinking && last_user.is_some_and(|u| i >= u);
            out.push_str(if opens_thinking {
                THINK_OPEN
            } else {
                THINK_CLOSE
            });
        }
    }
    Ok(out)
}

/// Token ids of [`deepseek_v4`]'s prompt. The tokenizer must know each
/// special string as one token, or the prompt would be split into pieces
/// the model never saw: that is refused, naming the missing string.
pub fn deepseek_v4_ids(
    tok: &Tokenizer,
    messages: &[ChatMessage],
    thinking: bool,
) -> Result<Vec<u32>, String> {
    for s in [
        DSV4_BOS,
        DSV4_EOS,
        DSV4_USER,
        DSV4_ASSISTANT,
        THINK_OPEN,
        THINK_CLOSE,
    ] {
        if tok.token_to_id(s).is_none() {
            return Err(format!(
                "{}: DeepSeek V4's chat encoding needs {s:?} as one token, and this tokenizer has no such token (is this DeepSeek V4's own tokenizer.json?)",
                tok.path.display()
            ));
        }
    }
    let text = deepseek_v4(messages, thinking)?;
    // The encoding writes BOS itself.
    tok.encode(&text, false).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(v: &[(&str, &str)]) -> Vec<ChatMessage> {
        v.iter().map(|(r, c)| ChatMessage::new(r, c)).collect()
    }

    #[test]
    fn system_and_user() {
        let m = msgs(&[("system", "Be brief."), ("user", "What is 2+2?")]);
        assert_eq!(
            deepseek_v4(&m, false).unwrap(),
            "<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 2+2?<｜Assistant｜></think>"
        );
        assert_eq!(
            deepseek_v4(&m, true).unwrap(),
            "<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 2+2?<｜Assistant｜><think>"
        );
    }

    #[test]
    fn earlier_turns_close_thinking() {
        let m = msgs(&[("user", "hi"), ("assistant", "Hello."), ("user", "2+2?")]);
        let head = "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>Hello.<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜>";
        assert_eq!(deepseek_v4(&m, true).unwrap(), format!("{head}<think>"));
        assert_eq!(deepseek_v4(&m, false).unwrap(), format!("{head}</think>"));
    }

    #[test]
    fn consecutive_users_and_a_trailing_assistant() {
        // A user message followed by another user message opens no turn; an
        // assistant message after the last user one (a prefilled reply) gets
        // the empty reasoning's </think> in thinking mode.
        let m = msgs(&[("user", "a"), ("user", "b"), ("assistant", "c")]);
        assert_eq!(
            deepseek_v4(&m, true).unwrap(),
            "<｜begin▁of▁sentence｜><｜User｜>a<｜User｜>b<｜Assistant｜><think></think>c<｜end▁of▁sentence｜>"
        );
        assert_eq!(
            deepseek_v4(&m, false).unwrap(),
            "<｜begin▁of▁sentence｜><｜User｜>a<｜User｜>b<｜Assistant｜></think>c<｜end▁of▁sentence｜>"
        );
    }

    #[test]
    fn other_roles_are_refused() {
        let err = deepseek_v4(&msgs(&[("tool", "{}")]), false).unwrap_err();
        assert!(err.contains("role \"tool\""), "{err}");
    }
}
